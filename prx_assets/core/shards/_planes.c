/*
 * JPEG planes for the shard stage: decode a JPEG to its own Y, Cb, Cr planes (each at its
 * stored resolution), Lanczos-3 each plane into the bucket, encode the planes as a 4:4:4
 * JPEG. See prx_assets/core/shards/resize.py for why, and for the Python-side contract.
 *
 * Why planes: a 4:2:0 JPEG stores chroma at a quarter of the pixels. Decoding to RGB
 * upsamples chroma and converts colour, Lanczos then filters three full-size channels,
 * and the encoder converts back: work on pixels the output never keeps. Here chroma is
 * resampled from its stored grid to the bucket's in one kernel (libjpeg's triangle
 * upsampling folded into the Lanczos-3), luma from its own grid; no colour conversion
 * happens on either side.
 *
 * Determinism: the decoder is libjpeg-turbo's accurate integer IDCT (raw output: no
 * upsampling, no colour conversion); the resampler is fixed-point (14-bit weights, 32-bit
 * sums), so its AVX2 and portable code give the same bytes (tested); the encoder is
 * libjpeg-turbo's accurate integer DCT with the standard tables at the given quality.
 *
 * Untrusted input: every libjpeg error (and, as in simplejpeg's strict mode, every libjpeg
 * warning: corrupt data) is a ValueError, never a partial image; the pixel limit is
 * checked on the header before any plane is allocated; sizes are checked for overflow.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) && !defined(LIBJPEG_TURBO_VERSION)
#error "prx_assets needs libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev)"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PRX_X86 1
#include <immintrin.h>
#else
#define PRX_X86 0
#endif

#define STR2(x) #x
#define STR(x) STR2(x)

/* ------------------------------------------------------------------ errors */

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void error_exit(j_common_ptr cinfo) {
  ErrorManager *err = (ErrorManager *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

/* Warnings (level -1) are corrupt data: refused, as simplejpeg's strict mode does. Trace
 * messages (level >= 0) are ignored. */
static void emit_message(j_common_ptr cinfo, int level) {
  if (level < 0) error_exit(cinfo);
}

static void init_errors(ErrorManager *err) {
  jpeg_std_error(&err->pub);
  err->pub.error_exit = error_exit;
  err->pub.emit_message = emit_message;
  err->message[0] = '\0';
}

/* ------------------------------------------------------------------ decode */

#if JPEG_LIB_VERSION >= 70
#define COMP_SCALED_W(c) ((c)->DCT_h_scaled_size)
#define COMP_SCALED_H(c) ((c)->DCT_v_scaled_size)
#define MIN_SCALED(ci) ((ci)->min_DCT_v_scaled_size)
#else
#define COMP_SCALED_W(c) ((c)->DCT_scaled_size)
#define COMP_SCALED_H(c) ((c)->DCT_scaled_size)
#define MIN_SCALED(ci) ((ci)->min_DCT_scaled_size)
#endif

typedef struct {
  PyObject *planes[MAX_COMPONENTS]; /* bytes the decoder writes into: no copy afterwards */
  JSAMPROW *rows[MAX_COMPONENTS];
} DecodeBuffers;

/* Frees the row pointers and drops the planes (call with the GIL held). */
static void free_buffers(DecodeBuffers *b) {
  for (int i = 0; i < MAX_COMPONENTS; i++) {
    Py_CLEAR(b->planes[i]);
    free(b->rows[i]);
    b->rows[i] = NULL;
  }
}

PyDoc_STRVAR(decode_doc,
"decode(data, denom, max_pixels) -> (kind, width, height, planes)\n\n"
"Raw decode of a one-frame 8-bit YCbCr (3 components) or greyscale JPEG at 1/denom\n"
"(1, 2, 4 or 8). kind is 'YCbCr' or 'GRAY'; width, height the scaled output size; planes\n"
"a list of (bytes, plane_width, plane_height, valid_width, valid_height, stride): each\n"
"component at its own resolution, in rows of stride bytes (whole DCT blocks, as the\n"
"decoder wrote them: the padding past plane_width and plane_height is not image), valid_*\n"
"the extent in plane pixels that stands for the whole scaled image (the last column or row\n"
"of a subsampled plane may be partial). Raises\n"
"ValueError for other colour spaces, corrupt or truncated data (libjpeg warnings included)\n"
"and images over max_pixels (checked on the header).");

static PyObject *decode(PyObject *self, PyObject *args) {
  Py_buffer data;
  int denom;
  long long max_pixels;
  (void)self;
  if (!PyArg_ParseTuple(args, "y*iL", &data, &denom, &max_pixels)) return NULL;
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "denom must be 1, 2, 4 or 8, got %d", denom);
    return NULL;
  }
  struct jpeg_decompress_struct cinfo;
  ErrorManager err;
  /* State a longjmp must see as it was last written: on the heap, or volatile. */
  DecodeBuffers *buf = calloc(1, sizeof *buf);
  if (!buf) {
    PyBuffer_Release(&data);
    return PyErr_NoMemory();
  }
  memset(&cinfo, 0, sizeof cinfo);
  cinfo.err = &err.pub;
  init_errors(&err);
  char refusal[128] = "";
  volatile int gil_released = 0;
  PyThreadState *volatile thread = NULL;
  if (setjmp(err.jump)) {
    if (gil_released) PyEval_RestoreThread(thread);
    jpeg_destroy_decompress(&cinfo);
    free_buffers(buf);
    free(buf);
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    return NULL;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
  jpeg_read_header(&cinfo, TRUE);
  int nc = cinfo.num_components;
  if (cinfo.data_precision != 8) {
    snprintf(refusal, sizeof refusal, "%d-bit samples", cinfo.data_precision);
  } else if (!((cinfo.jpeg_color_space == JCS_YCbCr && nc == 3) ||
               (cinfo.jpeg_color_space == JCS_GRAYSCALE && nc == 1))) {
    snprintf(refusal, sizeof refusal, "colour space %d with %d components",
             (int)cinfo.jpeg_color_space, nc);
  } else if ((long long)cinfo.image_width * (long long)cinfo.image_height > max_pixels) {
    snprintf(refusal, sizeof refusal, "%ux%u exceeds the limit of %lld px",
             cinfo.image_width, cinfo.image_height, max_pixels);
  }
  if (refusal[0]) {
    jpeg_destroy_decompress(&cinfo);
    free(buf);
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "not decoded as planes: %s", refusal);
    return NULL;
  }
  cinfo.raw_data_out = TRUE;
  cinfo.do_fancy_upsampling = FALSE;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)denom;
  /* The output geometry (what jpeg_start_decompress will use), so the planes can be
   * allocated as Python bytes here, with the GIL, and decoded into without a copy. */
  jpeg_calc_output_dimensions(&cinfo);
  /* One iMCU row of output: max_v_samp_factor blocks of min_DCT_scaled_size lines. */
  int imcu_lines = cinfo.max_v_samp_factor * MIN_SCALED(&cinfo);
  size_t imcu_rows = (cinfo.output_height + (unsigned)imcu_lines - 1) / (unsigned)imcu_lines;
  size_t stride[MAX_COMPONENTS], comp_lines[MAX_COMPONENTS];
  /* What the result reports, read now: finishing the decompression frees comp_info. */
  Py_ssize_t plane_w[MAX_COMPONENTS], plane_h[MAX_COMPONENTS];
  double valid_w[MAX_COMPONENTS], valid_h[MAX_COMPONENTS];
  JDIMENSION out_w = cinfo.output_width, out_h = cinfo.output_height;
  for (int i = 0; i < nc; i++) {
    jpeg_component_info *comp = &cinfo.comp_info[i];
    plane_w[i] = (Py_ssize_t)comp->downsampled_width;
    plane_h[i] = (Py_ssize_t)comp->downsampled_height;
    /* The plane's share of the scaled image, in its own pixels (unrounded). */
    valid_w[i] = (double)cinfo.image_width * comp->h_samp_factor * COMP_SCALED_W(comp) /
                 (cinfo.max_h_samp_factor * (double)DCTSIZE);
    valid_h[i] = (double)cinfo.image_height * comp->v_samp_factor * COMP_SCALED_H(comp) /
                 (cinfo.max_v_samp_factor * (double)DCTSIZE);
    stride[i] = (size_t)comp->width_in_blocks * (size_t)COMP_SCALED_W(comp);
    comp_lines[i] = (size_t)comp->v_samp_factor * (size_t)COMP_SCALED_H(comp);
    size_t height = imcu_rows * comp_lines[i];
    if (stride[i] == 0 || height > (size_t)PY_SSIZE_T_MAX / stride[i]) {
      snprintf(err.message, sizeof err.message, "plane size overflows");
      longjmp(err.jump, 1);
    }
    buf->planes[i] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(stride[i] * height));
    buf->rows[i] = malloc(sizeof(JSAMPROW) * comp_lines[i]);
    if (!buf->planes[i] || !buf->rows[i]) {
      PyErr_Clear();
      snprintf(err.message, sizeof err.message, "out of memory");
      longjmp(err.jump, 1);
    }
  }
  JSAMPLE *pixels[MAX_COMPONENTS];
  for (int i = 0; i < nc; i++) pixels[i] = (JSAMPLE *)PyBytes_AS_STRING(buf->planes[i]);
  thread = PyEval_SaveThread();
  gil_released = 1;
  jpeg_start_decompress(&cinfo);
  size_t done = 0;
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPARRAY planes[MAX_COMPONENTS];
    for (int i = 0; i < nc; i++) {
      for (size_t r = 0; r < comp_lines[i]; r++)
        buf->rows[i][r] = pixels[i] + (done * comp_lines[i] + r) * stride[i];
      planes[i] = buf->rows[i];
    }
    if (jpeg_read_raw_data(&cinfo, planes, (JDIMENSION)imcu_lines) == 0) {
      snprintf(err.message, sizeof err.message, "no progress reading raw data");
      longjmp(err.jump, 1);
    }
    done++;
  }
  jpeg_finish_decompress(&cinfo);
  PyEval_RestoreThread(thread);
  gil_released = 0;

  PyObject *planes = PyList_New(nc);
  for (int i = 0; planes && i < nc; i++) {
    PyObject *item = Py_BuildValue("(Onnddn)", buf->planes[i], plane_w[i], plane_h[i], valid_w[i],
                                   valid_h[i], (Py_ssize_t)stride[i]);
    if (!item) {
      Py_CLEAR(planes);
      break;
    }
    PyList_SET_ITEM(planes, i, item);
  }
  PyObject *result = NULL;
  if (planes)
    result = Py_BuildValue("(sIIN)", nc == 3 ? "YCbCr" : "GRAY", out_w, out_h, planes);
  jpeg_destroy_decompress(&cinfo);
  free_buffers(buf);
  free(buf);
  PyBuffer_Release(&data);
  return result;
}

/* ------------------------------------------------------------------ resample */

#define PREC 14 /* fixed-point bits of a weight: 1.0 == 1 << PREC */

static double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return sin(x) / x;
}

static double lanczos3(double x) {
  return (x > -3.0 && x < 3.0) ? sinc(x) * sinc(x / 3.0) : 0.0;
}

/* lanczos3((x + xmin - center + 0.5) * ss) for x in [0, n): the same arguments as one call
 * per tap, with the sines of consecutive taps (a fixed step apart) by rotation, so an output
 * costs four trigonometric calls instead of two per tap (most of a kernel's cost). An
 * argument within 1e-6 of a zero of the sine is evaluated directly. */
static void lanczos3_taps(int xmin, double center, double ss, int n, double *w) {
  double u0 = (xmin - center + 0.5) * ss;
  double s1 = sin(M_PI * u0), c1 = cos(M_PI * u0), s3 = sin(M_PI * u0 / 3.0),
         c3 = cos(M_PI * u0 / 3.0);
  double ds1 = sin(M_PI * ss), dc1 = cos(M_PI * ss), ds3 = sin(M_PI * ss / 3.0),
         dc3 = cos(M_PI * ss / 3.0);
  for (int x = 0; x < n; x++) {
    double u = (x + xmin - center + 0.5) * ss;
    if (!(u > -3.0 && u < 3.0)) w[x] = 0.0;
    else if (fabs(u) < 1e-6) w[x] = lanczos3(u);
    else w[x] = (s1 / (M_PI * u)) * (s3 / (M_PI * u / 3.0));
    double t = s1 * dc1 + c1 * ds1;
    c1 = c1 * dc1 - s1 * ds1;
    s1 = t;
    t = s3 * dc3 + c3 * ds3;
    c3 = c3 * dc3 - s3 * ds3;
    s3 = t;
  }
}

typedef struct {
  int count;     /* outputs */
  int ksize;     /* stride of weights */
  int *first;    /* first input index of each output */
  int *taps;     /* inputs read by each output */
  int16_t *weights;
} Kernel;

static void free_kernel(Kernel *k) {
  free(k->first);
  free(k->taps);
  free(k->weights);
  memset(k, 0, sizeof *k);
}

/* Pillow's precompute_coeffs (Lanczos, support 3 scaled by the reduction), for outputs
 * [o0, o1) of a resize that maps source extent [0, extent) onto out_size outputs; inputs
 * are clamped to [0, in_size) and the weights of each output renormalised to 1.
 *
 * up > 1: the plane is subsampled chroma that a decoder would first upsample by up (2:
 * libjpeg's "fancy" triangle, 3/4 of the nearest sample and 1/4 of the next, edges
 * repeated; other factors: each sample repeated), and extent is in plane pixels. The
 * kernel is then that upsampling and the Lanczos on the upsampled grid (what the naive
 * decode-to-RGB-then-resize does to chroma), folded into one set of weights on the plane's
 * own grid: the same picture, without ever making the upsampled plane. */
static int make_kernel(Kernel *k, int in_size, double extent, int out_size, int o0, int o1,
                       int up) {
  memset(k, 0, sizeof *k);
  if (up < 1) up = 1;
  /* The grid the Lanczos runs on: the plane itself, or its upsampled version. */
  double full_extent = extent * up;
  int full_in = in_size;
  if (up > 1) {
    full_in = (int)ceil(full_extent - 1e-9);
    if (full_in > in_size * up) full_in = in_size * up;
    if (full_in < 1) full_in = 1;
  }
  double scale = full_extent / out_size;
  double filterscale = scale < 1.0 ? 1.0 : scale;
  double support = 3.0 * filterscale;
  double ss = 1.0 / filterscale;
  int n = o1 - o0;
  int full_k = (int)ceil(support) * 2 + 1;
  k->count = n;
  /* Folded, an output reads plane samples first..last, first = xmin / up - 1 and last =
   * (xmin + xmax - 1) / up + 1 (both clamped inwards) with xmax <= full_k, so at most
   * (xmax - 1) / up + 4 of them: floor((a + m) / up) - floor(a / up) <= floor(m / up) + 1.
   * (full_k / up + 3, the bound before, holds for up == 2 only: full_k is odd. A 4:1:1 JPEG's
   * chroma, up == 4, wrote past the weights.) */
  k->ksize = up == 1 ? full_k : (full_k - 1) / up + 4;
  k->first = malloc(sizeof(int) * (size_t)n);
  k->taps = malloc(sizeof(int) * (size_t)n);
  k->weights = calloc((size_t)n * (size_t)k->ksize, sizeof(int16_t));
  double *w = malloc(sizeof(double) * (size_t)full_k);
  double *folded = calloc((size_t)k->ksize, sizeof(double));
  if (!k->first || !k->taps || !k->weights || !w || !folded) {
    free(w);
    free(folded);
    free_kernel(k);
    return -1;
  }
  for (int i = 0; i < n; i++) {
    double center = (o0 + i + 0.5) * scale;
    int xmin = (int)(center - support + 0.5);
    int xmax = (int)(center + support + 0.5);
    if (xmin < 0) xmin = 0;
    if (xmax > full_in) xmax = full_in;
    xmax -= xmin;
    if (xmax > full_k) xmax = full_k;
    if (xmax < 1) { /* an output with no input: the nearest edge pixel */
      xmin = center < 0 ? 0 : full_in - 1;
      xmax = 1;
      w[0] = 1.0;
    } else {
      lanczos3_taps(xmin, center, ss, xmax, w);
      double total = 0.0;
      for (int x = 0; x < xmax; x++) total += w[x];
      for (int x = 0; x < xmax; x++) w[x] = total != 0.0 ? w[x] / total : 0.0;
    }
    int first = xmin, taps = xmax;
    const double *weights = w;
    if (up > 1) { /* fold the upsampling in: weights on the plane's own samples */
      first = (xmin / up) - 1;
      if (first < 0) first = 0;
      int last = (xmin + xmax - 1) / up + 1;
      if (last > in_size - 1) last = in_size - 1;
      taps = last - first + 1;
      for (int t = 0; t < taps; t++) folded[t] = 0.0;
      for (int x = 0; x < xmax; x++) {
        int c = (xmin + x) / up;
        if (c > in_size - 1) c = in_size - 1;
        if (up == 2) {
          int next = (xmin + x) % 2 == 0 ? c - 1 : c + 1;
          if (next < 0) next = 0;
          if (next > in_size - 1) next = in_size - 1;
          folded[c - first] += 0.75 * w[x];
          folded[next - first] += 0.25 * w[x];
        } else {
          folded[c - first] += w[x];
        }
      }
      weights = folded;
    }
    for (int x = 0; x < taps; x++) {
      double v = weights[x] * (1 << PREC);
      if (v > 32767.0) v = 32767.0; /* unreachable for Lanczos-3; keeps int16 exact */
      if (v < -32768.0) v = -32768.0;
      k->weights[(size_t)i * k->ksize + x] = (int16_t)lrint(v);
    }
    k->first[i] = first;
    k->taps[i] = taps;
  }
  free(w);
  free(folded);
  return 0;
}

/* The last row and column kernels made on this thread, by their parameters: a JPEG's two
 * chroma planes share one geometry, so the second reuses the first's kernels. Per thread,
 * so a kernel in use while the GIL is released is never replaced by another thread. */
typedef struct {
  int valid, in_size, out_size, o0, o1, up;
  double extent;
  Kernel kernel;
} CachedKernel;

static __thread CachedKernel kernel_cache[2];

static const Kernel *cached_kernel(int slot, int in_size, double extent, int out_size, int o0,
                                   int o1, int up) {
  CachedKernel *c = &kernel_cache[slot];
  if (c->valid && c->in_size == in_size && c->extent == extent && c->out_size == out_size &&
      c->o0 == o0 && c->o1 == o1 && c->up == up)
    return &c->kernel;
  if (c->valid) free_kernel(&c->kernel);
  c->valid = 0;
  if (make_kernel(&c->kernel, in_size, extent, out_size, o0, o1, up) != 0) return NULL;
  c->up = up;
  c->in_size = in_size;
  c->extent = extent;
  c->out_size = out_size;
  c->o0 = o0;
  c->o1 = o1;
  c->valid = 1;
  return &c->kernel;
}

static inline uint8_t clip_shift(int32_t v) {
  v >>= PREC;
  return v < 0 ? 0 : (v > 255 ? 255 : (uint8_t)v);
}

/* out[y][x] = sum_t w[y][t] * in[first[y] + t][x], for every y of the kernel and every x
 * in [x0, width): the portable code, and the tail of the SIMD one. */
static void filter_rows_portable(const uint8_t *in, size_t in_stride, int x0, int width,
                                 const Kernel *k, uint8_t *out, size_t out_stride) {
  for (int y = 0; y < k->count; y++) {
    const int16_t *w = k->weights + (size_t)y * k->ksize;
    const uint8_t *base = in + (size_t)k->first[y] * in_stride;
    uint8_t *o = out + (size_t)y * out_stride;
    int n = k->taps[y];
    for (int x = x0; x < width; x++) {
      int32_t acc = 1 << (PREC - 1);
      for (int t = 0; t < n; t++) acc += (int32_t)base[(size_t)t * in_stride + x] * w[t];
      o[x] = clip_shift(acc);
    }
  }
}

#if PRX_X86
/* The same sums, 32 columns at a time: two taps per multiply-add (pixel pairs as 16-bit
 * lanes against a pair of weights), 32-bit sums, then the same shift and clamp (packs and
 * packus saturate exactly as clip_shift clamps). */
__attribute__((target("avx2"))) static void filter_rows_avx2(const uint8_t *in, size_t in_stride,
                                                             int width, const Kernel *k,
                                                             uint8_t *out, size_t out_stride) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i half = _mm256_set1_epi32(1 << (PREC - 1));
  int x_end = width - width % 32;
  for (int y = 0; y < k->count; y++) {
    const int16_t *w = k->weights + (size_t)y * k->ksize;
    const uint8_t *base = in + (size_t)k->first[y] * in_stride;
    uint8_t *o = out + (size_t)y * out_stride;
    int n = k->taps[y];
    for (int x = 0; x < x_end; x += 32) {
      __m256i a0 = half, a1 = half, a2 = half, a3 = half;
      int t = 0;
      for (; t + 2 <= n; t += 2) {
        const uint8_t *r = base + (size_t)t * in_stride + x;
        __m256i p0 = _mm256_loadu_si256((const __m256i *)r);
        __m256i p1 = _mm256_loadu_si256((const __m256i *)(r + in_stride));
        __m256i c = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)w[t] |
                                                ((uint32_t)(uint16_t)w[t + 1] << 16)));
        __m256i lo = _mm256_unpacklo_epi8(p0, p1), hi = _mm256_unpackhi_epi8(p0, p1);
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), c));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), c));
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), c));
        a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), c));
      }
      if (t < n) {
        __m256i p0 = _mm256_loadu_si256((const __m256i *)(base + (size_t)t * in_stride + x));
        __m256i c = _mm256_set1_epi32((int32_t)(uint32_t)(uint16_t)w[t]);
        __m256i lo = _mm256_unpacklo_epi8(p0, zero), hi = _mm256_unpackhi_epi8(p0, zero);
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), c));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), c));
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), c));
        a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), c));
      }
      /* Per 128-bit lane: a0 = columns 0-3, a1 = 4-7, a2 = 8-11, a3 = 12-15; the packs
       * below put each lane's 16 columns back in order. */
      __m256i s01 = _mm256_packs_epi32(_mm256_srai_epi32(a0, PREC), _mm256_srai_epi32(a1, PREC));
      __m256i s23 = _mm256_packs_epi32(_mm256_srai_epi32(a2, PREC), _mm256_srai_epi32(a3, PREC));
      _mm256_storeu_si256((__m256i *)(o + x), _mm256_packus_epi16(s01, s23));
    }
  }
  if (x_end < width) filter_rows_portable(in, in_stride, x_end, width, k, out, out_stride);
}

/* A 16x16 block of bytes transposed with SSE2 unpacks (x86-64 baseline). */
static inline void transpose16(const uint8_t *in, size_t in_stride, uint8_t *out,
                               size_t out_stride) {
  static const int order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  __m128i a[16], b[16];
  for (int i = 0; i < 16; i++) a[i] = _mm_loadu_si128((const __m128i *)(in + i * in_stride));
  for (int i = 0; i < 8; i++) {
    b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 2; j++) {
      a[4 * i + j] = _mm_unpacklo_epi16(b[4 * i + j], b[4 * i + j + 2]);
      a[4 * i + j + 2] = _mm_unpackhi_epi16(b[4 * i + j], b[4 * i + j + 2]);
    }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++) {
      b[8 * i + j] = _mm_unpacklo_epi32(a[8 * i + j], a[8 * i + j + 4]);
      b[8 * i + j + 4] = _mm_unpackhi_epi32(a[8 * i + j], a[8 * i + j + 4]);
    }
  for (int j = 0; j < 8; j++) {
    a[j] = _mm_unpacklo_epi64(b[j], b[j + 8]);
    a[j + 8] = _mm_unpackhi_epi64(b[j], b[j + 8]);
  }
  for (int m = 0; m < 16; m++) _mm_storeu_si128((__m128i *)(out + order[m] * out_stride), a[m]);
}
#endif

/* out (cols x rows) = in (rows x cols) transposed, in 16x16 blocks taken 64 rows at a time:
 * four blocks down a column of the input fill whole 64-byte lines of the output before the
 * next column, so a large plane is not written a quarter line at a time. */
static void transpose(const uint8_t *in, size_t in_stride, int rows, int cols, uint8_t *out,
                      int simd) {
  const int B = 16, T = 64;
  for (int rt = 0; rt < rows; rt += T) {
    int rt1 = rt + T < rows ? rt + T : rows;
    for (int c0 = 0; c0 < cols; c0 += B) {
      int c1 = c0 + B < cols ? c0 + B : cols;
      for (int r0 = rt; r0 < rt1; r0 += B) {
        int r1 = r0 + B < rt1 ? r0 + B : rt1;
#if PRX_X86
        if (simd && r1 - r0 == B && c1 - c0 == B) {
          transpose16(in + (size_t)r0 * in_stride + c0, in_stride, out + (size_t)c0 * rows + r0,
                      (size_t)rows);
          continue;
        }
#else
        (void)simd;
#endif
        for (int r = r0; r < r1; r++)
          for (int c = c0; c < c1; c++) out[(size_t)c * rows + r] = in[(size_t)r * in_stride + c];
      }
    }
  }
}

static int have_avx2(void) {
#if PRX_X86
  static int cached = -1;
  if (cached < 0) {
    __builtin_cpu_init();
    cached = __builtin_cpu_supports("avx2") ? 1 : 0;
  }
  return cached;
#else
  return 0;
#endif
}

static void filter_rows(const uint8_t *in, size_t in_stride, int width, const Kernel *k,
                        uint8_t *out, size_t out_stride, int simd) {
#if PRX_X86
  if (simd && have_avx2()) {
    filter_rows_avx2(in, in_stride, width, k, out, out_stride);
    return;
  }
#endif
  (void)simd;
  filter_rows_portable(in, in_stride, 0, width, k, out, out_stride);
}

PyDoc_STRVAR(resample_doc,
"resample(plane, width, height, valid_width, valid_height, out_width, out_height, box,\n"
"         simd=True, stride=width, upsample=(1, 1)) -> bytes\n\n"
"Lanczos-3 of a width x height 8-bit plane (rows stride bytes apart) scaled so that its\n"
"valid extent (from the top left corner) becomes out_width x out_height, cropped to\n"
"box = (left, top, right, bottom)\n"
"of that canvas: Pillow's resize, step for step (pixel centres, per-axis scale, support\n"
"widened by the reduction, kernel renormalised at the edges, columns first and rounded to\n"
"8 bits, then rows), with 14-bit weights. Only the box, and the source rows it reads, are\n"
"computed. upsample=(x, y): the plane is chroma stored at 1/x by 1/y that a decoder would\n"
"upsample first (2: libjpeg's triangle, else repetition), valid_* in plane pixels; the\n"
"upsampling is folded into the kernel (see make_kernel). simd=False runs the portable code\n"
"(the same bytes).");

static PyObject *resample(PyObject *self, PyObject *args, PyObject *kwargs) {
  static char *keywords[] = {"plane",  "width", "height", "valid_width", "valid_height",
                             "out_width", "out_height", "box", "simd", "stride", "upsample",
                             NULL};
  Py_buffer plane;
  int w, h, ow, oh, left, top, right, bottom, simd = 1, up_x = 1, up_y = 1;
  Py_ssize_t stride = -1;
  double vw, vh;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*iiddii(iiii)|pn(ii)", keywords, &plane, &w,
                                   &h, &vw, &vh, &ow, &oh, &left, &top, &right, &bottom, &simd,
                                   &stride, &up_x, &up_y))
    return NULL;
  if (stride < 0) stride = w;
  const char *bad = NULL;
  if (w < 1 || h < 1 || ow < 1 || oh < 1) bad = "sizes must be positive";
  else if (stride < w) bad = "stride must be at least width";
  else if (up_x < 1 || up_x > 4 || up_y < 1 || up_y > 4) bad = "upsample factors must be 1..4";
  else if (stride * (h - 1) + w > plane.len) bad = "plane holds fewer than width x height bytes";
  else if (!(vw > 0 && vw <= w && vh > 0 && vh <= h)) bad = "valid extent outside the plane";
  else if (!(0 <= left && left < right && right <= ow && 0 <= top && top < bottom && bottom <= oh))
    bad = "box outside the output canvas";
  if (bad) {
    PyBuffer_Release(&plane);
    PyErr_SetString(PyExc_ValueError, bad);
    return NULL;
  }
  int cw = right - left, ch = bottom - top;
  const Kernel *cols_k = cached_kernel(1, w, vw, ow, left, right, up_x);
  const Kernel *cached_rows = cols_k ? cached_kernel(0, h, vh, oh, top, bottom, up_y) : NULL;
  /* The source rows the box reads, and the row kernel re-based on the first of them (a
   * shallow copy: the cached one keeps its own indices). */
  Kernel rows_k;
  memset(&rows_k, 0, sizeof rows_k);
  int fail = cached_rows == NULL;
  int r0 = h, r1 = 0;
  if (!fail) {
    rows_k = *cached_rows;
    rows_k.first = malloc(sizeof(int) * (size_t)rows_k.count);
    fail = rows_k.first == NULL;
  }
  for (int i = 0; !fail && i < rows_k.count; i++) {
    if (cached_rows->first[i] < r0) r0 = cached_rows->first[i];
    if (cached_rows->first[i] + rows_k.taps[i] > r1) r1 = cached_rows->first[i] + rows_k.taps[i];
  }
  for (int i = 0; !fail && i < rows_k.count; i++) rows_k.first[i] = cached_rows->first[i] - r0;
  int nr = fail ? 1 : r1 - r0;
  uint8_t *turned = malloc((size_t)w * nr); /* source rows, transposed: w x nr */
  uint8_t *narrow = malloc((size_t)cw * nr); /* columns filtered (transposed): cw x nr */
  uint8_t *wide = malloc((size_t)nr * cw);   /* back in rows: nr x cw */
  PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cw * ch);
  if (fail || !turned || !narrow || !wide || !result) {
    free(turned);
    free(narrow);
    free(wide);
    free(rows_k.first);
    Py_XDECREF(result);
    PyBuffer_Release(&plane);
    return PyErr_NoMemory();
  }
  uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(result);
  Py_BEGIN_ALLOW_THREADS
  /* Columns: filtering the transposed rows is filtering along the row, SIMD-friendly. */
  transpose((const uint8_t *)plane.buf + (size_t)r0 * stride, (size_t)stride, nr, w, turned, simd);
  filter_rows(turned, (size_t)nr, nr, cols_k, narrow, (size_t)nr, simd);
  transpose(narrow, (size_t)nr, cw, nr, wide, simd);
  filter_rows(wide, (size_t)cw, cw, &rows_k, dst, (size_t)cw, simd);
  Py_END_ALLOW_THREADS
  free(turned);
  free(narrow);
  free(wide);
  free(rows_k.first);
  PyBuffer_Release(&plane);
  return result;
}

/* ------------------------------------------------------------------ encode */

PyDoc_STRVAR(encode_doc,
"encode(y, cb, cr, width, height, quality) -> bytes\n\n"
"A baseline 4:4:4 YCbCr JPEG of three width x height planes: libjpeg's standard tables at\n"
"quality, accurate integer DCT, standard Huffman tables, a JFIF header and nothing else\n"
"(no EXIF, ICC profile, comment or timestamp: same planes, same bytes).");

typedef struct {
  unsigned char *bytes;
  unsigned long size;
} Buffer;

/* What encode() holds, released on either way out (the GIL held). */
static void release_encode(struct jpeg_compress_struct *cinfo, Buffer *out, Buffer *pad,
                           Py_buffer *planes) {
  jpeg_destroy_compress(cinfo);
  if (out) free(out->bytes);
  free(out);
  if (pad) free(pad->bytes);
  free(pad);
  for (int i = 0; i < 3; i++) PyBuffer_Release(&planes[i]);
}

static PyObject *encode(PyObject *self, PyObject *args) {
  Py_buffer p[3];
  int w, h, quality;
  (void)self;
  if (!PyArg_ParseTuple(args, "y*y*y*iii", &p[0], &p[1], &p[2], &w, &h, &quality)) return NULL;
  const char *bad = NULL;
  if (w < 1 || h < 1 || w > JPEG_MAX_DIMENSION || h > JPEG_MAX_DIMENSION) bad = "bad size";
  else if (quality < 1 || quality > 100) bad = "quality must be in 1..100";
  for (int i = 0; !bad && i < 3; i++)
    if (p[i].len < (Py_ssize_t)w * h) bad = "a plane holds fewer than width x height bytes";
  if (bad) {
    for (int i = 0; i < 3; i++) PyBuffer_Release(&p[i]);
    PyErr_SetString(PyExc_ValueError, bad);
    return NULL;
  }
  struct jpeg_compress_struct cinfo;
  ErrorManager err;
  /* libjpeg grows the output buffer through these: on the heap, so a longjmp sees them. */
  Buffer *out = calloc(1, sizeof *out), *pad = calloc(1, sizeof *pad);
  memset(&cinfo, 0, sizeof cinfo);
  if (!out || !pad) {
    release_encode(&cinfo, out, pad, p);
    return PyErr_NoMemory();
  }
  cinfo.err = &err.pub;
  init_errors(&err);
  volatile int gil_released = 0;
  PyThreadState *volatile thread = NULL;
  if (setjmp(err.jump)) {
    if (gil_released) PyEval_RestoreThread(thread);
    release_encode(&cinfo, out, pad, p);
    PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    return NULL;
  }
  jpeg_create_compress(&cinfo);
  /* A first buffer that a q92 4:4:4 photo does not outgrow (about a third of a byte per
   * pixel; libjpeg grows it if need be), instead of libjpeg's 4 KiB doubled a dozen times. */
  out->size = (unsigned long)w * (unsigned long)h + 65536;
  out->bytes = malloc(out->size);
  if (!out->bytes) out->size = 0;
  jpeg_mem_dest(&cinfo, &out->bytes, &out->size);
  cinfo.image_width = (JDIMENSION)w;
  cinfo.image_height = (JDIMENSION)h;
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_YCbCr;
  jpeg_set_defaults(&cinfo);
  jpeg_set_colorspace(&cinfo, JCS_YCbCr);
  for (int i = 0; i < 3; i++) cinfo.comp_info[i].h_samp_factor = cinfo.comp_info[i].v_samp_factor = 1;
  jpeg_set_quality(&cinfo, quality, TRUE);
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.optimize_coding = FALSE;
  cinfo.raw_data_in = TRUE;
  cinfo.write_JFIF_header = TRUE;
  cinfo.write_Adobe_marker = FALSE;
  thread = PyEval_SaveThread();
  gil_released = 1;
  jpeg_start_compress(&cinfo, TRUE);
  /* Raw input is read in whole 8x8 blocks: a width that is not a multiple of 8 is padded
   * by repeating the last column (what libjpeg's own edge expansion does), and rows past
   * the last repeat it. */
  size_t padded = ((size_t)w + DCTSIZE - 1) / DCTSIZE * DCTSIZE;
  if (padded != (size_t)w) {
    pad->bytes = malloc(3 * DCTSIZE * padded);
    if (!pad->bytes) {
      snprintf(err.message, sizeof err.message, "out of memory");
      longjmp(err.jump, 1);
    }
  }
  JSAMPROW rows[3][DCTSIZE];
  JSAMPARRAY planes[3] = {rows[0], rows[1], rows[2]};
  while (cinfo.next_scanline < cinfo.image_height) {
    for (int i = 0; i < 3; i++)
      for (int r = 0; r < DCTSIZE; r++) {
        JDIMENSION y = cinfo.next_scanline + (JDIMENSION)r;
        if (y >= (JDIMENSION)h) y = (JDIMENSION)h - 1;
        JSAMPROW src = (JSAMPROW)((unsigned char *)p[i].buf + (size_t)y * (size_t)w);
        if (pad->bytes) {
          JSAMPROW dst = pad->bytes + ((size_t)i * DCTSIZE + (size_t)r) * padded;
          memcpy(dst, src, (size_t)w);
          memset(dst + w, src[w - 1], padded - (size_t)w);
          src = dst;
        }
        rows[i][r] = src;
      }
    jpeg_write_raw_data(&cinfo, planes, DCTSIZE);
  }
  jpeg_finish_compress(&cinfo);
  PyEval_RestoreThread(thread);
  gil_released = 0;
  PyObject *result = PyBytes_FromStringAndSize((const char *)out->bytes, (Py_ssize_t)out->size);
  release_encode(&cinfo, out, pad, p);
  return result;
}

/* ------------------------------------------------------------------ module */

static PyObject *simd_kernels(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(have_avx2() ? "avx2" : (PRX_X86 ? "sse2-transpose" : "portable"));
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {"resample", (PyCFunction)(void (*)(void))resample, METH_VARARGS | METH_KEYWORDS, resample_doc},
    {"encode", encode, METH_VARARGS, encode_doc},
    {"simd_kernels", simd_kernels, METH_NOARGS, "The resampler's code path on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes",
    "JPEG planes for the shard stage (libjpeg-turbo raw decode and encode, Lanczos-3).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__planes(void) {
  PyObject *m = PyModule_Create(&module);
  if (!m) return NULL;
#ifdef LIBJPEG_TURBO_VERSION
  PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", STR(LIBJPEG_TURBO_VERSION));
#else
  PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", "unknown");
#endif
  PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION);
  PyModule_AddIntConstant(m, "PRECISION_BITS", PREC);
  return m;
}
