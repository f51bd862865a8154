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
 *
 * Copies and events, for the layer-piece pipeline (tiercache.gpu.layer_pieces): ``make_copy(dst, dst_dev,
 * dst_pitch, src, src_dev, src_pitch, width, height)`` returns a capsule holding one 2D copy (``height`` rows
 * of ``width`` bytes; ``*_dev``: a device address, else host memory), ``copy(capsule, stream)`` queues it
 * (``cuMemcpy2DAsync``), ``copies(capsules, stream)`` queues a list of them in one call (the copy-engine
 * path, tiercache.gpu.copy_engine), ``record(event, stream)`` and ``wait_event(stream, event)`` order streams
 * (``cuEventRecord``, ``cuStreamWaitEvent``), and ``context(ordinal)`` makes the device's primary context
 * current on a thread that has none (as the CUDA runtime does on a thread's first call). Each returns the
 * driver's status. ``same_items(items, reference)`` checks a container's items by identity (below).
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

typedef void *CUevent;
typedef void *CUcontext;
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    unsigned long long srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    unsigned long long dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
enum { MEMORY_HOST = 1, MEMORY_DEVICE = 2 };
typedef CUresult (*copy2d_fn)(const CUDA_MEMCPY2D *, CUstream);
typedef CUresult (*record_fn)(CUevent, CUstream);
typedef CUresult (*wait_event_fn)(CUstream, CUevent, unsigned);
typedef CUresult (*ctx_get_fn)(CUcontext *);
typedef CUresult (*device_get_fn)(int *, int);
typedef CUresult (*retain_fn)(CUcontext *, int);
typedef CUresult (*ctx_set_fn)(CUcontext);

static copy2d_fn cu_copy2d;
static record_fn cu_record;
static wait_event_fn cu_wait_event;
static ctx_get_fn cu_ctx_get;
static device_get_fn cu_device_get;
static retain_fn cu_retain;
static ctx_set_fn cu_ctx_set;

/* libcuda, opened once, or NULL with OSError set. */
static void *driver_lib(void) {
    static void *lib;
    if (!lib)
        lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib)
        PyErr_SetString(PyExc_OSError, "libcuda.so.1 cannot be opened");
    return lib;
}

static int load_driver(void) {
    if (cu_launch && cu_param_info && cu_sync)
        return 0;
    void *lib = driver_lib();
    if (!lib)
        return -1;
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

/* The copy and event entry points (all of CUDA 4.0's API): 0, or -1 with OSError set. */
static int load_copies(void) {
    if (cu_copy2d)
        return 0;
    void *lib = driver_lib();
    if (!lib)
        return -1;
    cu_record = (record_fn)dlsym(lib, "cuEventRecord");
    cu_wait_event = (wait_event_fn)dlsym(lib, "cuStreamWaitEvent");
    cu_ctx_get = (ctx_get_fn)dlsym(lib, "cuCtxGetCurrent");
    cu_device_get = (device_get_fn)dlsym(lib, "cuDeviceGet");
    cu_retain = (retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
    cu_ctx_set = (ctx_set_fn)dlsym(lib, "cuCtxSetCurrent");
    copy2d_fn copy2d = (copy2d_fn)dlsym(lib, "cuMemcpy2DAsync_v2");
    if (!copy2d || !cu_record || !cu_wait_event || !cu_ctx_get || !cu_device_get || !cu_retain || !cu_ctx_set) {
        PyErr_SetString(PyExc_OSError, "libcuda.so.1 lacks a copy, event or context entry point");
        return -1;
    }
    cu_copy2d = copy2d;
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

static const char COPY_CAPSULE[] = "tiercache.gpu._launch.Copy";

static void free_copy(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, COPY_CAPSULE)); }

static PyObject *tc_make_copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    int dst_dev, src_dev;
    Py_ssize_t dst_pitch, src_pitch, width, height;
    if (!PyArg_ParseTuple(args, "KpnKpnnn", &dst, &dst_dev, &dst_pitch, &src, &src_dev, &src_pitch, &width,
                          &height))
        return NULL;
    if (width <= 0 || height <= 0 || dst_pitch < width || src_pitch < width) {
        PyErr_SetString(PyExc_ValueError, "a copy needs width > 0, height > 0 and pitches >= width");
        return NULL;
    }
    if (load_copies() < 0)
        return NULL;
    CUDA_MEMCPY2D *c = calloc(1, sizeof(CUDA_MEMCPY2D));
    if (!c)
        return PyErr_NoMemory();
    c->srcMemoryType = src_dev ? MEMORY_DEVICE : MEMORY_HOST;
    if (src_dev)
        c->srcDevice = src;
    else
        c->srcHost = (const void *)(uintptr_t)src;
    c->srcPitch = (size_t)src_pitch;
    c->dstMemoryType = dst_dev ? MEMORY_DEVICE : MEMORY_HOST;
    if (dst_dev)
        c->dstDevice = dst;
    else
        c->dstHost = (void *)(uintptr_t)dst;
    c->dstPitch = (size_t)dst_pitch;
    c->WidthInBytes = (size_t)width;
    c->Height = (size_t)height;
    PyObject *capsule = PyCapsule_New(c, COPY_CAPSULE, free_copy);
    if (!capsule)
        free(c);
    return capsule;
}

/* A handle argument (an int) into ``out``: 0, or -1 with an exception set. */
static int handle_arg(PyObject *arg, void **out) {
    *out = (void *)(uintptr_t)PyLong_AsUnsignedLongLongMask(arg);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *tc_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(capsule, stream)");
        return NULL;
    }
    CUDA_MEMCPY2D *c = (CUDA_MEMCPY2D *)PyCapsule_GetPointer(args[0], COPY_CAPSULE);
    void *stream;
    if (!c || handle_arg(args[1], &stream) < 0)
        return NULL;
    return PyLong_FromLong(cu_copy2d(c, (CUstream)stream));
}

/* copies(handles, stream): queue every copy of a list or tuple of ``make_copy`` capsules, in order; the first
 * status that is not 0, else 0. */
static PyObject *tc_copies(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "copies(list of capsules, stream)");
        return NULL;
    }
    void *stream;
    if (handle_arg(args[1], &stream) < 0 || load_copies() < 0)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
    PyObject **items = PySequence_Fast_ITEMS(args[0]);
    for (Py_ssize_t i = 0; i < n; i++) {
        CUDA_MEMCPY2D *c = (CUDA_MEMCPY2D *)PyCapsule_GetPointer(items[i], COPY_CAPSULE);
        if (!c)
            return NULL;
        CUresult rc = cu_copy2d(c, (CUstream)stream);
        if (rc)
            return PyLong_FromLong(rc);
    }
    return PyLong_FromLong(0);
}

/* Batched 1D copies (the driver's cuMemcpyBatchAsync, CUDA 12.8+): ``make_batch(dsts, srcs, sizes)`` (bytes of
 * uint64 addresses and sizes, host addresses as the unified address space has them) returns a capsule;
 * ``batch(capsule, stream)`` queues every copy in stream order (source read in stream order, the copy engines
 * preferred so that compute keeps the SMs) and returns the driver's status. OSError from ``make_batch`` where
 * the driver has no batched copies. */
typedef struct { int type; int id; } MemLocation;
typedef struct {
    int srcAccessOrder;
    MemLocation srcLocHint, dstLocHint;
    unsigned int flags;
} MemcpyAttributes;
enum { SRC_ACCESS_ORDER_STREAM = 1, FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1 };
typedef CUresult (*batch13_fn)(unsigned long long *, unsigned long long *, size_t *, size_t, MemcpyAttributes *,
                               size_t *, size_t, CUstream);
typedef CUresult (*batch12_fn)(unsigned long long *, unsigned long long *, size_t *, size_t, MemcpyAttributes *,
                               size_t *, size_t, size_t *, CUstream);
static batch13_fn cu_batch13;
static batch12_fn cu_batch12;

static int load_batch(void) {
    if (cu_batch13 || cu_batch12)
        return 0;
    void *lib = driver_lib();
    if (!lib)
        return -1;
    cu_batch13 = (batch13_fn)dlsym(lib, "cuMemcpyBatchAsync_v2");  /* CUDA 13: no failIdx */
    if (!cu_batch13)
        cu_batch12 = (batch12_fn)dlsym(lib, "cuMemcpyBatchAsync");
    if (!cu_batch13 && !cu_batch12) {
        PyErr_SetString(PyExc_OSError, "libcuda.so.1 lacks cuMemcpyBatchAsync (a driver older than CUDA 12.8)");
        return -1;
    }
    return 0;
}

typedef struct {
    size_t count;
    unsigned long long *dsts, *srcs;
    size_t *sizes;
} Batch;

static const char BATCH_CAPSULE[] = "tiercache.gpu._launch.Batch";

static void free_batch(PyObject *capsule) {
    Batch *b = (Batch *)PyCapsule_GetPointer(capsule, BATCH_CAPSULE);
    if (b) {
        free(b->dsts);
        free(b);
    }
}

static PyObject *tc_make_batch(PyObject *self, PyObject *args) {
    Py_buffer d, s, z;
    if (!PyArg_ParseTuple(args, "y*y*y*", &d, &s, &z))
        return NULL;
    PyObject *out = NULL;
    size_t n = (size_t)d.len / 8;
    if (d.len % 8 || s.len != d.len || z.len != d.len || n == 0) {
        PyErr_SetString(PyExc_ValueError, "make_batch needs three equal, non-empty arrays of 8-byte values");
        goto done;
    }
    if (load_batch() < 0)
        goto done;
    Batch *b = calloc(1, sizeof(Batch));
    char *mem = b ? malloc(3 * (size_t)d.len) : NULL;
    if (!mem) {
        free(b);
        PyErr_NoMemory();
        goto done;
    }
    memcpy(mem, d.buf, (size_t)d.len);
    memcpy(mem + d.len, s.buf, (size_t)d.len);
    memcpy(mem + 2 * d.len, z.buf, (size_t)d.len);
    b->count = n;
    b->dsts = (unsigned long long *)mem;
    b->srcs = (unsigned long long *)(mem + d.len);
    b->sizes = (size_t *)(mem + 2 * d.len);
    out = PyCapsule_New(b, BATCH_CAPSULE, free_batch);
    if (!out) {
        free(mem);
        free(b);
    }
done:
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    PyBuffer_Release(&z);
    return out;
}

static PyObject *tc_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "batch(capsule, stream)");
        return NULL;
    }
    Batch *b = (Batch *)PyCapsule_GetPointer(args[0], BATCH_CAPSULE);
    void *stream;
    if (!b || handle_arg(args[1], &stream) < 0 || load_batch() < 0)
        return NULL;
    MemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = SRC_ACCESS_ORDER_STREAM;
    attr.flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE;
    size_t first = 0, fail = 0;
    CUresult rc = cu_batch13 ? cu_batch13(b->dsts, b->srcs, b->sizes, b->count, &attr, &first, 1, (CUstream)stream)
                             : cu_batch12(b->dsts, b->srcs, b->sizes, b->count, &attr, &first, 1, &fail,
                                          (CUstream)stream);
    return PyLong_FromLong(rc);
}

/* The two handle arguments of ``usage`` (record, wait_event): 0, or -1 with an exception set. */
static int two_handles(PyObject *const *args, Py_ssize_t nargs, const char *usage, void **a, void **b) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (handle_arg(args[0], a) < 0 || handle_arg(args[1], b) < 0 || load_copies() < 0)
        return -1;
    return 0;
}

static PyObject *tc_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *event, *stream;
    if (two_handles(args, nargs, "record(event, stream)", &event, &stream) < 0)
        return NULL;
    return PyLong_FromLong(cu_record((CUevent)event, (CUstream)stream));
}

static PyObject *tc_wait_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *stream, *event;
    if (two_handles(args, nargs, "wait_event(stream, event)", &stream, &event) < 0)
        return NULL;
    return PyLong_FromLong(cu_wait_event((CUstream)stream, (CUevent)event, 0));
}

static PyObject *tc_context(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "context(ordinal)");
        return NULL;
    }
    long ordinal = PyLong_AsLong(args[0]);
    if ((ordinal == -1 && PyErr_Occurred()) || load_copies() < 0)
        return NULL;
    CUcontext ctx = NULL;
    CUresult rc = cu_ctx_get(&ctx);
    if (rc != 0 || ctx != NULL)
        return PyLong_FromLong(rc);
    int dev = 0;
    if ((rc = cu_device_get(&dev, (int)ordinal)) == 0 && (rc = cu_retain(&ctx, dev)) == 0)
        rc = cu_ctx_set(ctx);
    return PyLong_FromLong(rc);
}

/* same_items(items, reference): True when ``items`` (a list, a tuple or an exact dict's values, in order)
 * holds exactly the objects of the tuple ``reference`` (identity), False when not, None for any other kind of
 * container (the caller checks it itself). The repeat path of a bound move checks its KV caches this way. */
static PyObject *tc_same_items(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "same_items(items, reference tuple)");
        return NULL;
    }
    PyObject *items = args[0], *ref = args[1];
    Py_ssize_t n = PyTuple_GET_SIZE(ref);
    if (PyDict_CheckExact(items)) {
        if (PyDict_GET_SIZE(items) != n)
            Py_RETURN_FALSE;
        Py_ssize_t pos = 0, i = 0;
        PyObject *key, *value;
        while (PyDict_Next(items, &pos, &key, &value))
            if (value != PyTuple_GET_ITEM(ref, i++))
                Py_RETURN_FALSE;
        Py_RETURN_TRUE;
    }
    if (!PyList_CheckExact(items) && !PyTuple_CheckExact(items))
        Py_RETURN_NONE;
    if (PySequence_Fast_GET_SIZE(items) != n)
        Py_RETURN_FALSE;
    PyObject **got = PySequence_Fast_ITEMS(items);
    for (Py_ssize_t i = 0; i < n; i++)
        if (got[i] != PyTuple_GET_ITEM(ref, i))
            Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyMethodDef METHODS[] = {
    {"same_items", (PyCFunction)(void (*)(void))tc_same_items, METH_FASTCALL,
     "same_items(items, reference) -> True, False or None"},
    {"make_copy", tc_make_copy, METH_VARARGS,
     "make_copy(dst, dst_dev, dst_pitch, src, src_dev, src_pitch, width, height) -> capsule"},
    {"copy", (PyCFunction)(void (*)(void))tc_copy, METH_FASTCALL, "copy(capsule, stream) -> status"},
    {"copies", (PyCFunction)(void (*)(void))tc_copies, METH_FASTCALL, "copies(capsules, stream) -> status"},
    {"make_batch", tc_make_batch, METH_VARARGS, "make_batch(dsts, srcs, sizes) -> capsule"},
    {"batch", (PyCFunction)(void (*)(void))tc_batch, METH_FASTCALL, "batch(capsule, stream) -> status"},
    {"record", (PyCFunction)(void (*)(void))tc_record, METH_FASTCALL, "record(event, stream) -> status"},
    {"wait_event", (PyCFunction)(void (*)(void))tc_wait_event, METH_FASTCALL, "wait_event(stream, event) -> status"},
    {"context", (PyCFunction)(void (*)(void))tc_context, METH_FASTCALL, "context(ordinal) -> status"},
    {"make", tc_make, METH_VARARGS, "make(function, gx, gy, gz, block_x, shared, params, offsets) -> capsule"},
    {"launch", (PyCFunction)(void (*)(void))tc_launch, METH_FASTCALL, "launch(capsule, stream) -> status"},
    {"param_size", tc_param_size, METH_VARARGS, "param_size(function, index) -> bytes or None"},
    {"sync", (PyCFunction)(void (*)(void))tc_sync, METH_FASTCALL, "sync(stream) -> status"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_launch", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__launch(void) { return PyModule_Create(&MODULE); }
