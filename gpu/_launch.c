/* Kernel launches with their parameters packed once, for tiercache.gpu.launch (a CPython extension).
 *
 * ``make(function, gx, gy, gz, block_x, shared, params, offsets)`` copies ``params`` (the bytes of every
 * kernel parameter, packed by the caller) and returns a capsule holding the CUfunction, the launch shape and
 * a pointer per parameter (``offsets[i]`` into the copy); ``launch(capsule, stream)`` calls the driver's
 * ``cuLaunchKernel`` with them and returns its status (0: launched), so a repeated launch costs one call with
 * two arguments. ``param_size(function, i)`` is the driver's size of parameter i (None past the last;
 * ``cuFuncGetParamInfo``), ``sync(stream)`` waits for a stream (``cuStreamSynchronize``, the GIL released)
 * and returns its status. libcuda is opened on first use (``dlopen``): without it, or with a driver older
 * than CUDA 12.4, ``make`` and ``param_size`` raise OSError. No CUDA headers: the few types are declared here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);
typedef CUresult (*param_info_fn)(CUfunction, size_t, size_t *, size_t *);
typedef CUresult (*sync_fn)(CUstream);

static launch_fn cu_launch;
static param_info_fn cu_param_info;
static sync_fn cu_sync;

static int load_driver(void) {
    if (cu_launch && cu_param_info && cu_sync)
        return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        PyErr_SetString(PyExc_OSError, "libcuda.so.1 cannot be opened");
        return -1;
    }
    cu_launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    cu_param_info = (param_info_fn)dlsym(lib, "cuFuncGetParamInfo");
    cu_sync = (sync_fn)dlsym(lib, "cuStreamSynchronize");
    if (!cu_launch || !cu_param_info || !cu_sync) {
        cu_launch = NULL;
        PyErr_SetString(PyExc_OSError, "libcuda.so.1 lacks cuLaunchKernel, cuFuncGetParamInfo or "
                                       "cuStreamSynchronize (a driver older than CUDA 12.4)");
        return -1;
    }
    return 0;
}

typedef struct {
    CUfunction function;
    unsigned grid[3];
    unsigned block;
    unsigned shared;
    char *storage;   /* the packed parameter values */
    void **params;   /* one pointer per parameter into storage */
} Launch;

static const char CAPSULE[] = "tiercache.gpu._launch.Launch";

static void free_launch(PyObject *capsule) {
    Launch *l = (Launch *)PyCapsule_GetPointer(capsule, CAPSULE);
    if (l) {
        free(l->storage);
        free(l->params);
        free(l);
    }
}

static PyObject *tc_make(PyObject *self, PyObject *args) {
    unsigned long long function;
    unsigned gx, gy, gz, block, shared;
    Py_buffer params;
    PyObject *offsets;
    if (!PyArg_ParseTuple(args, "KIIIIIy*O", &function, &gx, &gy, &gz, &block, &shared, &params, &offsets))
        return NULL;
    PyObject *seq = PySequence_Fast(offsets, "offsets must be a sequence of ints");
    if (!seq || load_driver() < 0) {
        Py_XDECREF(seq);
        PyBuffer_Release(&params);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Launch *l = calloc(1, sizeof(Launch));
    char *storage = malloc(params.len > 0 ? (size_t)params.len : 1);
    void **ptrs = calloc(n > 0 ? (size_t)n : 1, sizeof(void *));
    if (!l || !storage || !ptrs) {
        free(l), free(storage), free(ptrs);
        Py_DECREF(seq);
        PyBuffer_Release(&params);
        return PyErr_NoMemory();
    }
    memcpy(storage, params.buf, (size_t)params.len);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (off < 0 || off >= params.len) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "parameter %zd lies outside the packed values", i);
            free(l), free(storage), free(ptrs);
            Py_DECREF(seq);
            PyBuffer_Release(&params);
            return NULL;
        }
        ptrs[i] = storage + off;
    }
    Py_DECREF(seq);
    PyBuffer_Release(&params);
    l->function = (CUfunction)(uintptr_t)function;
    l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz;
    l->block = block;
    l->shared = shared;
    l->storage = storage;
    l->params = ptrs;
    PyObject *capsule = PyCapsule_New(l, CAPSULE, free_launch);
    if (!capsule) {
        free(l), free(storage), free(ptrs);
    }
    return capsule;
}

static PyObject *tc_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "launch(capsule, stream)");
        return NULL;
    }
    Launch *l = (Launch *)PyCapsule_GetPointer(args[0], CAPSULE);
    if (!l)
        return NULL;
    CUstream stream = (CUstream)(uintptr_t)PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred())
        return NULL;
    CUresult rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cu_launch(l->function, l->grid[0], l->grid[1], l->grid[2], l->block, 1, 1, l->shared, stream,
                   l->params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *tc_param_size(PyObject *self, PyObject *args) {
    unsigned long long function;
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "Kn", &function, &index) || load_driver() < 0)
        return NULL;
    size_t offset = 0, size = 0;
    if (index < 0 || cu_param_info((CUfunction)(uintptr_t)function, (size_t)index, &offset, &size) != 0)
        Py_RETURN_NONE;
    return PyLong_FromSize_t(size);
}

static PyObject *tc_sync(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "sync(stream)");
        return NULL;
    }
    CUstream stream = (CUstream)(uintptr_t)PyLong_AsUnsignedLongLongMask(args[0]);
    if (PyErr_Occurred() || load_driver() < 0)
        return NULL;
    CUresult rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cu_sync(stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef METHODS[] = {
    {"make", tc_make, METH_VARARGS, "make(function, gx, gy, gz, block_x, shared, params, offsets) -> capsule"},
    {"launch", (PyCFunction)(void (*)(void))tc_launch, METH_FASTCALL, "launch(capsule, stream) -> status"},
    {"param_size", tc_param_size, METH_VARARGS, "param_size(function, index) -> bytes or None"},
    {"sync", (PyCFunction)(void (*)(void))tc_sync, METH_FASTCALL, "sync(stream) -> status"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_launch", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__launch(void) { return PyModule_Create(&MODULE); }
