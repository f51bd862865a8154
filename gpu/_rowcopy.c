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
 * dir 0 (gather) copies paged -> object; dir 1 (scatter) object -> paged. Slots < 0 are skipped (the
 * caller has rejected them for a gather). Tokens are walked in order and, within a token, heads then
 * planes, so a token's paged bytes are touched in address order. Stores bypass the cache (streaming)
 * when rows and addresses are 16-byte aligned: the data is not read back soon and it saves the
 * read-for-ownership traffic. Returns the number of slots >= 0 over all spans.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { SPAN_OBJ, SPAN_O_PLANE, SPAN_O_LAYER, SPAN_O_TOK, SPAN_SLOT0, SPAN_N_TOK, SPAN_TOK0, SPAN_FIELDS };

static inline void copy_row(char *dst, const char *src, int64_t n, int stream) {
#if defined(__SSE2__)
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

int64_t tc_copy_rows(int dir, int64_t n_layers, const int64_t *layers, int64_t n_spans, const int64_t *spans,
                     const int64_t *slots, int64_t bs, int64_t s_blk, int64_t s_off, int64_t s_head,
                     int64_t heads, int64_t planes, const int64_t *poff, int64_t row_bytes) {
  int stream = 0;
#if defined(__SSE2__)
  stream = (row_bytes % 16) == 0;
#endif
  int64_t valid = 0;
  for (int64_t i = 0; i < n_spans; i++) {
    const int64_t *sp = spans + i * SPAN_FIELDS;
    const int64_t *sl = slots + sp[SPAN_SLOT0];
    for (int64_t t = 0; t < sp[SPAN_N_TOK]; t++) valid += sl[t] >= 0;
    for (int64_t j = 0; j < n_layers; j++) {
      const char *layer = (const char *)(intptr_t)layers[j];
      char *obj = (char *)(intptr_t)sp[SPAN_OBJ] + j * sp[SPAN_O_LAYER] + sp[SPAN_TOK0] * sp[SPAN_O_TOK];
      for (int64_t t = 0; t < sp[SPAN_N_TOK]; t++) {
        int64_t slot = sl[t];
        if (slot < 0) continue;
        char *page = (char *)layer + (slot / bs) * s_blk + (slot % bs) * s_off;
        char *orow = obj + t * sp[SPAN_O_TOK];
        for (int64_t h = 0; h < heads; h++) {
          for (int64_t p = 0; p < planes; p++) {
            char *a = page + h * s_head + poff[p];
            char *b = orow + p * sp[SPAN_O_PLANE] + h * row_bytes;
            if (dir == 0)
              copy_row(b, a, row_bytes, stream);
            else
              copy_row(a, b, row_bytes, stream);
          }
        }
      }
    }
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();
#endif
  return valid;
}
