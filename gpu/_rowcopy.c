/* Row copies between paged KV layers and L1 objects on the CPU, for tiercache.gpu.cpu_rows (ctypes).
 *
 * Plain C (no Python or torch headers): setup.py builds it as an optional extension with the system
 * compiler; without it the torch reference path runs. Bit-exact byte copies of whole rows.
 *
 * A row is the contiguous run of one (token, head, plane) of one layer: ``row_bytes`` bytes.
 * For span i (7 int64 fields: obj, o_plane, o_layer, o_tok, slot0, n_tok, tok0), layer j, token t, head h,
 * plane p, with slot = slots[slot0 + t]:
 *   paged  = layers[j] + (slot / bs) * s_blk + (slot % bs) * s_off + h * s_head + poff[p]
 *   object = obj + p * o_plane + j * o_layer + (tok0 + t) * o_tok + h * row_bytes
 * dir 0 (gather) copies paged -> object; dir 1 (scatter) object -> paged. Slots < 0 are skipped where
 * allowed (a scatter's tokens without KV); every slot is checked before any byte moves (tc_copy_rows).
 * Tokens are walked in order and, within a token, heads then planes, so a token's paged bytes are touched
 * in address order. ``stores``: 0 plain ``memcpy``; 1 stores that bypass the cache (streaming) where rows
 * and addresses are 16-byte aligned (the data is not read back soon, and it saves the read-for-ownership
 * traffic); 2 the same with one 64-byte store per line where the CPU has AVX-512F and rows and addresses
 * are 64-byte aligned (else as 1). Returns the number of slots >= 0 over all spans, or a negative error
 * code. Threads (an OpenMP team: the caller's thread and the runtime's kept workers, ``run_job``) take
 * (span, layer) tasks in turn; two spans that write one slot (never in a request) race.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { SPAN_OBJ, SPAN_O_PLANE, SPAN_O_LAYER, SPAN_O_TOK, SPAN_SLOT0, SPAN_N_TOK, SPAN_TOK0, SPAN_FIELDS };

/* A row of at least LONG_ROW bytes (a CPU_BLOCKS page) is copied as STREAMS interleaved parts, one line
 * of each in turn: one sequential stream per thread left the memory system idle (a 256-token CPU_BLOCKS
 * gather at 12.8 GB/s, 0.88 of a bare copy; 15.5 in four parts, two or eight measured lower). */
enum { LONG_ROW = 4096, STREAMS = 4 };

static inline int long_row(int64_t n) { return n >= LONG_ROW && n % (STREAMS * 64) == 0; }

static inline void copy_row(char *dst, const char *src, int64_t n, int stream) {
#if defined(__SSE2__)
  if (stream && (((uintptr_t)dst | (uintptr_t)src) & 15) == 0 && long_row(n)) {
    int64_t part = n / STREAMS;
    for (int64_t i = 0; i < part; i += 16) {
      __m128i a = _mm_load_si128((const __m128i *)(src + i));
      __m128i b = _mm_load_si128((const __m128i *)(src + part + i));
      __m128i c = _mm_load_si128((const __m128i *)(src + 2 * part + i));
      __m128i d = _mm_load_si128((const __m128i *)(src + 3 * part + i));
      _mm_stream_si128((__m128i *)(dst + i), a);
      _mm_stream_si128((__m128i *)(dst + part + i), b);
      _mm_stream_si128((__m128i *)(dst + 2 * part + i), c);
      _mm_stream_si128((__m128i *)(dst + 3 * part + i), d);
    }
    return;
  }
  if (stream && (((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_load_si128((const __m128i *)(src + i));
      __m128i b = _mm_load_si128((const __m128i *)(src + i + 16));
      __m128i c = _mm_load_si128((const __m128i *)(src + i + 32));
      __m128i d = _mm_load_si128((const __m128i *)(src + i + 48));
      _mm_stream_si128((__m128i *)(dst + i), a);
      _mm_stream_si128((__m128i *)(dst + i + 16), b);
      _mm_stream_si128((__m128i *)(dst + i + 32), c);
      _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i < n; i += 16) _mm_stream_si128((__m128i *)(dst + i), _mm_load_si128((const __m128i *)(src + i)));
    return;
  }
#endif
  (void)stream;
  memcpy(dst, src, (size_t)n);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TC_WIDE 1
/* One 64-byte streaming store per cache line (AVX-512F; the caller checked the CPU has it): a line leaves
 * the write-combining buffer whole, and a gather measured ~8 % faster than with 16-byte stores. */
__attribute__((target("avx512f"))) static inline void copy_row_wide(char *dst, const char *src, int64_t n,
                                                                   int stream) {
  if (stream && (((uintptr_t)dst | (uintptr_t)src) & 63) == 0 && (n & 63) == 0) {
    if (long_row(n)) {
      int64_t part = n / STREAMS;
      for (int64_t i = 0; i < part; i += 64) {
        __m512i a = _mm512_load_si512((const void *)(src + i));
        __m512i b = _mm512_load_si512((const void *)(src + part + i));
        __m512i c = _mm512_load_si512((const void *)(src + 2 * part + i));
        __m512i d = _mm512_load_si512((const void *)(src + 3 * part + i));
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + part + i), b);
        _mm512_stream_si512((void *)(dst + 2 * part + i), c);
        _mm512_stream_si512((void *)(dst + 3 * part + i), d);
      }
      return;
    }
    for (int64_t i = 0; i < n; i += 64)
      _mm512_stream_si512((void *)(dst + i), _mm512_load_si512((const void *)(src + i)));
    return;
  }
  copy_row(dst, src, n, stream);
}
#endif

/* A gather reads each token's paged rows (its heads and planes, in address order) as one read stream per
 * thread, which the hardware prefetchers restart at every 4 KiB page: too few reads in flight, a gather ran
 * at 0.78-0.88 of a one-thread memcpy (which keeps four pages in flight) while a scatter, reading an
 * object's two planes, ran at 1.1-1.2. So a gather prefetches the rows of the token PREFETCH_BYTES ahead
 * (tokens of up to PREFETCH_MAX_TOKEN bytes; longer runs are long enough for the hardware): 0.98-1.04 of
 * the memcpy at 256 and 4096 Llama-8B tokens (4 KiB a token and layer); 4 and 16 KiB ahead measured lower. */
enum { PREFETCH_BYTES = 8192, PREFETCH_MAX_TOKEN = 16384 };

struct job {
  int dir, stream, wide;
  int64_t ahead; /* gather: prefetch the rows of the token this many ahead (0: none) */
  int64_t n_layers, n_tasks;
  const int64_t *layers, *spans, *slots, *poff;
  int64_t bs, s_blk, s_off, s_head, heads, planes, row_bytes;
  int64_t next; /* next task (span * n_layers + layer), taken atomically */
};

/* One task: every token, head and plane of one span in one layer (``wide``: a constant per instance). */
static inline __attribute__((always_inline)) void task_body(const struct job *g, int64_t k, int wide) {
  const int64_t *sp = g->spans + (k / g->n_layers) * SPAN_FIELDS;
  int64_t j = k % g->n_layers;
  const int64_t *sl = g->slots + sp[SPAN_SLOT0];
  const char *layer = (const char *)(intptr_t)g->layers[j];
  char *obj = (char *)(intptr_t)sp[SPAN_OBJ] + j * sp[SPAN_O_LAYER] + sp[SPAN_TOK0] * sp[SPAN_O_TOK];
  for (int64_t t = 0; t < sp[SPAN_N_TOK]; t++) {
    int64_t slot = sl[t];
    if (slot < 0) continue;
    char *page = (char *)layer + (slot / g->bs) * g->s_blk + (slot % g->bs) * g->s_off;
    char *orow = obj + t * sp[SPAN_O_TOK];
    const char *next = NULL; /* the paged token ``ahead`` tokens on, to prefetch */
    if (g->ahead && t + g->ahead < sp[SPAN_N_TOK] && sl[t + g->ahead] >= 0) {
      int64_t s2 = sl[t + g->ahead];
      next = layer + (s2 / g->bs) * g->s_blk + (s2 % g->bs) * g->s_off;
    }
    for (int64_t h = 0; h < g->heads; h++) {
      for (int64_t p = 0; p < g->planes; p++) {
        char *a = page + h * g->s_head + g->poff[p];
        char *b = orow + p * sp[SPAN_O_PLANE] + h * g->row_bytes;
        if (next) {
          const char *q = next + h * g->s_head + g->poff[p];
          for (int64_t i = 0; i < g->row_bytes; i += 64) __builtin_prefetch(q + i, 0, 3);
        }
        char *to = g->dir == 0 ? b : a;
        const char *from = g->dir == 0 ? a : b;
#if defined(TC_WIDE)
        if (wide) {
          copy_row_wide(to, from, g->row_bytes, g->stream);
          continue;
        }
#endif
        (void)wide;
        copy_row(to, from, g->row_bytes, g->stream);
      }
    }
  }
}

static void run_task(const struct job *g, int64_t k) { task_body(g, k, 0); }
#if defined(TC_WIDE)
__attribute__((target("avx512f"))) static void run_task_wide(const struct job *g, int64_t k) {
  task_body(g, k, 1);
}
#endif

/* Take tasks until none is left. */
static void run_tasks(struct job *g) {
  for (;;) {
    int64_t k = __atomic_fetch_add(&g->next, 1, __ATOMIC_RELAXED);
    if (k >= g->n_tasks) break;
#if defined(TC_WIDE)
    if (g->wide) {
      run_task_wide(g, k);
      continue;
    }
#endif
    run_task(g, k);
  }
#if defined(__SSE2__)
  if (g->stream) _mm_sfence(); /* streaming stores visible before the hand-back */
#endif
}

/* A forked child: its parent's OpenMP workers do not exist in it, and libgomp would wait for them. */
static volatile int forked_child;
static void after_fork_child(void) { forked_child = 1; }
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Run ``g`` on ``threads`` threads: an OpenMP team of the caller's thread and the runtime's kept workers.
 * In a process that has loaded torch, this library binds to torch's own libgomp (same soname), so a copy
 * runs on the worker pool torch's intra-op work uses instead of on threads of its own: helper threads of
 * our own lost the second core to torch's workers, which spin for a while after each parallel op, and a
 * 2-thread copy ran at the speed of one (vs_lmcache.py cpu: 6.8-8.6 GB/s against 11.5-14.7 on the pool).
 * In a forked child, and without OpenMP at build time, every copy runs on the caller's thread. */
static void run_job(struct job *g, int64_t threads) {
  pthread_once(&fork_once, register_fork);
#if defined(_OPENMP)
  if (threads > 1 && !forked_child) {
#pragma omp parallel num_threads((int)threads)
    run_tasks(g);
    return;
  }
#endif
  (void)threads;
  run_tasks(g);
}

/* Every slot of every span is checked before anything is copied: a slot >= ``n_slots`` returns
 * TC_OUT_OF_RANGE, a slot < 0 where ``negative_ok`` is 0 TC_NEGATIVE, and nothing is written. Else the
 * copy runs; ``threads`` > 1: that many threads (the caller's included) take (span, layer) tasks in turn. */
enum { TC_NEGATIVE = -1, TC_OUT_OF_RANGE = -2 };
int64_t tc_copy_rows(int dir, int64_t n_layers, const int64_t *layers, int64_t n_spans, const int64_t *spans,
                     const int64_t *slots, int64_t bs, int64_t s_blk, int64_t s_off, int64_t s_head,
                     int64_t heads, int64_t planes, const int64_t *poff, int64_t row_bytes, int64_t threads,
                     int stores, int64_t n_slots, int negative_ok) {
  struct job g = {dir, 0, 0, 0, n_layers, n_spans * n_layers, layers, spans, slots, poff,
                  bs, s_blk, s_off, s_head, heads, planes, row_bytes, 0};
  int64_t token_bytes = heads * planes * row_bytes;
  if (dir == 0 && token_bytes > 0 && token_bytes <= PREFETCH_MAX_TOKEN)
    g.ahead = (PREFETCH_BYTES + token_bytes - 1) / token_bytes;
#if defined(__SSE2__)
  g.stream = stores > 0 && (row_bytes % 16) == 0;
#endif
#if defined(TC_WIDE)
  g.wide = stores > 1 && g.stream && (row_bytes % 64) == 0 && __builtin_cpu_supports("avx512f");
#endif
  int64_t valid = 0, total = 0, over = 0;
  for (int64_t i = 0; i < n_spans; i++) {
    const int64_t *sp = spans + i * SPAN_FIELDS;
    const int64_t *sl = slots + sp[SPAN_SLOT0];
    total += sp[SPAN_N_TOK];
    for (int64_t t = 0; t < sp[SPAN_N_TOK]; t++) {
      valid += sl[t] >= 0;
      over |= sl[t] >= n_slots;
    }
  }
  if (over) return TC_OUT_OF_RANGE;
  if (valid != total && !negative_ok) return TC_NEGATIVE;
  if (threads > g.n_tasks) threads = g.n_tasks;
  run_job(&g, threads);
  return valid;
}
