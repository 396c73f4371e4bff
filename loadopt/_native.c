/* loadopt's native module: crops (and mirrors) of stored HWC uint8 images into a batch with streaming
 * stores, the same cropped from files (mapped where cached), and the normalisation of uint8 batches into floats.
 *
 * Why native: a crop writes every byte of a batch that the CPU never reads again (the device copy
 * or DMA does). Ordinary stores first read each destination cache line from memory (read for
 * ownership), so a crop moves 3 bytes through DRAM per byte delivered where `memcpy` of a large
 * buffer (non-temporal stores) moves 2; streaming stores bring crops to the copy's rate. The mirror
 * of 3-byte pixels is done 16 pixels at a time with byte shuffles (SSSE3) instead of per pixel.
 *
 * crop_batch(out, sources, which, offsets, flips, stride, size, first, last[, threads])
 *   out      writable buffer, C-contiguous (n, size, size, 3) uint8
 *   sources  sequence of buffers holding the stored images
 *   which    int32[n]: the source of each sample
 *   offsets  int64[n]: byte offset in its source of the crop's top-left pixel
 *   flips    uint8[n]: 1 to mirror the crop left-right
 *   stride   bytes from one stored row to the next
 *   first, last: the samples [first, last) to write
 *   threads  threads copying (this one and threads - 1 started for the call), a sample at a time
 * The GIL is released while copying.
 *
 * read_crops(out, maps, fds, which, offsets, flips, stride, size, first, last, threads[, check])
 *   The same crops from files: `maps[s]` a read-only mapping of shard s, `fds[s]` its descriptor,
 *   `which[k]` sample k's shard, `offsets[k]` the file offset of its top-left pixel. Where mincore says
 *   the crop's rows are all in the page cache they are cropped straight from the mapping: one copy, as
 *   `crop_batch` (a pread into a buffer first, the kernel's copy, would cost the page-cache path half its
 *   rate). Otherwise one pread of the rows into a per-thread buffer that stays in the core's cache, a
 *   crop from there, and a miss counted. `threads` threads (this one and threads - 1 started for the
 *   call) take the samples one at a time. Returns (misses, failed position or -1, errno or -1 for a file
 *   that ended). One call per batch: no Python per sample or per thread; the GIL released throughout.
 *   `check` 0: no mincore; every sample cropped from its mapping (a page not cached is read in by the page
 *   fault), and the misses returned are the threads' major faults during the call (getrusage): a caller
 *   that saw a batch all cached checks the next ones this way. mincore per sample costs posix's warm
 *   crops a system call a sample (its entry and exit, and mmap's lock).
 *
 * uncached(maps, which, offsets, lengths) -> int
 *   How many of the samples (`lengths[k]` bytes at `offsets[k]` of mapping `maps[which[k]]`) are not all
 *   in the page cache (mincore: nothing read or mapped). The GIL is released.
 *
 * normalise(out, inputs, scale, shift) -> bool
 *   out[i] = inputs[i] * scale[i % 3] + shift[i % 3] (one fused multiply-add), uint8 HWC in, float32
 *   out, in one pass with streaming stores; torch needs a conversion copy (a scalar loop) and then an
 *   `addcmul`. Equal to `addcmul` bit for bit. False (nothing written) on a CPU without AVX2 and FMA.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

static long page_size = 4096; /* set at import */

#if defined(__SSSE3__)
#include <immintrin.h>
#include <math.h>
#define LOADOPT_SIMD 1
static __m128i flip_masks[3][3]; /* [destination vector][source vector] */
#else
#define LOADOPT_SIMD 0
#endif

static void init_masks(void) {
#if LOADOPT_SIMD
    for (int v = 0; v < 3; v++) {
        uint8_t mask[3][16];
        memset(mask, 0x80, sizeof mask); /* 0x80: pshufb writes a zero */
        for (int i = 0; i < 16; i++) {
            int d = 16 * v + i, pixel = d / 3, channel = d % 3;
            int s = 3 * (15 - pixel) + channel;
            mask[s / 16][i] = (uint8_t)(s % 16);
        }
        for (int sv = 0; sv < 3; sv++) flip_masks[v][sv] = _mm_loadu_si128((const __m128i *)mask[sv]);
    }
#endif
}

#if LOADOPT_SIMD
static int have_avx2; /* set at import */

/* 128 bytes a step in 32-byte streaming stores (dst 32-byte aligned): more per core than 16-byte steps
   (bench: a crop of a mapped 256 px square per sample); the rest in 16-byte steps. */
__attribute__((target("avx2"))) static Py_ssize_t stream_avx2(uint8_t *dst, const uint8_t *src, Py_ssize_t bytes) {
    Py_ssize_t done = 0;
    for (; done + 128 <= bytes; done += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + done));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + done + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + done + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + done + 96));
        _mm256_stream_si256((__m256i *)(dst + done), a);
        _mm256_stream_si256((__m256i *)(dst + done + 32), b);
        _mm256_stream_si256((__m256i *)(dst + done + 64), c);
        _mm256_stream_si256((__m256i *)(dst + done + 96), d);
    }
    for (; done + 32 <= bytes; done += 32)
        _mm256_stream_si256((__m256i *)(dst + done), _mm256_loadu_si256((const __m256i *)(src + done)));
    return done;
}
#endif

/* One row of `width` pixels, copied or mirrored. `stream`: dst is 16-byte aligned (streaming stores). */
static void copy_row(uint8_t *dst, const uint8_t *src, Py_ssize_t width, int flip, int stream) {
    Py_ssize_t bytes = 3 * width, done = 0;
#if LOADOPT_SIMD
    if (!flip && stream) {
        if (have_avx2 && ((uintptr_t)dst & 31) == 0) done = stream_avx2(dst, src, bytes);
        for (; done + 16 <= bytes; done += 16)
            _mm_stream_si128((__m128i *)(dst + done), _mm_loadu_si128((const __m128i *)(src + done)));
        memcpy(dst + done, src + done, (size_t)(bytes - done));
        return;
    }
    if (flip) {
        /* Source pixels [16h, 16h + 16) become destination pixels [width - 16h - 16, width - 16h), reversed.
           The source is read forwards (a backward walk defeats the prefetcher: 3x slower from memory);
           the destination's 48-byte groups stay 16-byte aligned only when a row is a multiple of 16 bytes. */
        Py_ssize_t groups = width / 16;
        stream = stream && bytes % 16 == 0;
        for (Py_ssize_t h = 0; h < groups; h++) {
            const uint8_t *from = src + 48 * h;
            uint8_t *to = dst + 3 * (width - 16 * h - 16);
            __m128i s0 = _mm_loadu_si128((const __m128i *)from);
            __m128i s1 = _mm_loadu_si128((const __m128i *)(from + 16));
            __m128i s2 = _mm_loadu_si128((const __m128i *)(from + 32));
            for (int v = 0; v < 3; v++) {
                __m128i d = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(s0, flip_masks[v][0]),
                                                      _mm_shuffle_epi8(s1, flip_masks[v][1])),
                                         _mm_shuffle_epi8(s2, flip_masks[v][2]));
                if (stream)
                    _mm_stream_si128((__m128i *)(to + 16 * v), d);
                else
                    _mm_storeu_si128((__m128i *)(to + 16 * v), d);
            }
        }
        done = 16 * groups; /* source pixels [0, done) are written */
    }
#endif
    if (!flip) {
        memcpy(dst, src, (size_t)bytes);
        return;
    }
    for (Py_ssize_t i = done; i < width; i++) { /* source pixel i -> destination pixel width - 1 - i */
        uint8_t *to = dst + 3 * (width - 1 - i);
        to[0] = src[3 * i];
        to[1] = src[3 * i + 1];
        to[2] = src[3 * i + 2];
    }
}

static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len < itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", name, view->len, itemsize * count);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Read `length` bytes at `offset` into `buffer`: 0, or the errno (-1: the file ended first). */
static int read_fully(int fd, uint8_t *buffer, Py_ssize_t length, int64_t offset) {
    Py_ssize_t done = 0;
    while (done < length) {
        ssize_t got = pread(fd, buffer + done, (size_t)(length - done), (off_t)(offset + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return errno;
        if (got == 0) return -1;
        done += got;
    }
    return 0;
}

/* Whether every page of [at, at + length) of a mapping is in the page cache (mincore: no read started,
   nothing mapped). `vector` holds a byte per page of the range. False where mincore fails. */
static int resident(const uint8_t *at, Py_ssize_t length, unsigned char *vector) {
    uintptr_t first = (uintptr_t)at & ~(uintptr_t)(page_size - 1);
    size_t pages = ((uintptr_t)at + (uintptr_t)length - first + page_size - 1) / page_size;
    if (mincore((void *)first, pages * page_size, vector) != 0) return 0;
    for (size_t i = 0; i < pages; i++)
        if (!(vector[i] & 1)) return 0;
    return 1;
}

/* One batch of crops, shared by the threads of one `crop_batch` or `read_crops` call: each takes the
   next sample until none is left or one failed. From buffers (`fd_at` NULL), or from mapped files. */
typedef struct {
    uint8_t *base;
    const Py_buffer *views;
    const int32_t *fd_at, *which_at;
    const int64_t *offset_at;
    const uint8_t *flip_at;
    Py_ssize_t stride, size, span, sample_bytes, last;
    Py_ssize_t next, misses, failed; /* atomics */
    int error;                       /* of the sample `failed` */
    int check;                       /* mapped files: mincore each sample (else count major faults) */
} crop_job;

static void *crop_worker(void *arg) {
    crop_job *job = arg;
    uint8_t *scratch = NULL;
    unsigned char *vector = malloc((size_t)(job->span / page_size + 2));
    struct rusage before;
    int faults = job->fd_at != NULL && !job->check && getrusage(RUSAGE_THREAD, &before) == 0;
    for (;;) {
        Py_ssize_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->last || __atomic_load_n(&job->failed, __ATOMIC_RELAXED) >= 0) break;
        const uint8_t *from = (const uint8_t *)job->views[job->which_at[k]].buf + job->offset_at[k];
        if (job->fd_at != NULL && job->check && (vector == NULL || !resident(from, job->span, vector))) {
            __atomic_fetch_add(&job->misses, 1, __ATOMIC_RELAXED);
            int error = scratch == NULL && (scratch = malloc((size_t)job->span)) == NULL ? ENOMEM : 0;
            if (error == 0) error = read_fully(job->fd_at[job->which_at[k]], scratch, job->span, job->offset_at[k]);
            if (error != 0) {
                Py_ssize_t none = -1;
                if (__atomic_compare_exchange_n(&job->failed, &none, k, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
                    job->error = error;
                break;
            }
            from = scratch;
        }
        uint8_t *dst = job->base + k * job->sample_bytes;
        for (Py_ssize_t row = 0; row < job->size; row++) {
            uint8_t *to = dst + row * 3 * job->size;
            copy_row(to, from + row * job->stride, job->size, job->flip_at[k] != 0, ((uintptr_t)to & 15) == 0);
        }
    }
#if LOADOPT_SIMD
    _mm_sfence(); /* this thread's streaming stores, visible before the join hands the batch over */
#endif
    struct rusage after;
    if (faults && getrusage(RUSAGE_THREAD, &after) == 0)
        __atomic_fetch_add(&job->misses, (Py_ssize_t)(after.ru_majflt - before.ru_majflt), __ATOMIC_RELAXED);
    free(scratch);
    free(vector);
    return NULL;
}

/* `threads` threads on `job` (this one and threads - 1 started for it; fewer where one cannot start). */
static void run_job(crop_job *job, Py_ssize_t threads) {
    pthread_t helpers[63];
    int started = 0;
    for (Py_ssize_t t = 1; t < threads && t < 64 && t < job->last - job->next; t++)
        if (pthread_create(&helpers[started], NULL, crop_worker, job) == 0) started++;
    crop_worker(job);
    for (int t = 0; t < started; t++) pthread_join(helpers[t], NULL);
}

static PyObject *crop_batch(PyObject *self, PyObject *args) {
    PyObject *out_obj, *sources_obj, *which_obj, *offsets_obj, *flips_obj;
    Py_ssize_t stride, size, first, last, threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOnnnn|n", &out_obj, &sources_obj, &which_obj, &offsets_obj, &flips_obj,
                          &stride, &size, &first, &last, &threads))
        return NULL;
    if (size <= 0 || first < 0 || last < first || stride < 3 * size || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "crop_batch: bad size, stride or sample range");
        return NULL;
    }
    PyObject *sources = PySequence_Fast(sources_obj, "crop_batch: sources must be a sequence of buffers");
    if (sources == NULL) return NULL;
    Py_ssize_t nsources = PySequence_Fast_GET_SIZE(sources);
    Py_buffer out = {0}, which = {0}, offsets = {0}, flips = {0};
    Py_buffer *views = PyMem_Calloc((size_t)(nsources > 0 ? nsources : 1), sizeof(Py_buffer));
    Py_ssize_t acquired = 0, sample_bytes = size * size * 3;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (out.len < last * sample_bytes) {
        PyErr_Format(PyExc_ValueError, "crop_batch: out holds %zd bytes, need %zd", out.len, last * sample_bytes);
        goto done;
    }
    if (get_array(which_obj, &which, 4, last, "which") < 0) goto done;
    if (get_array(offsets_obj, &offsets, 8, last, "offsets") < 0) goto done;
    if (get_array(flips_obj, &flips, 1, last, "flips") < 0) goto done;
    for (; acquired < nsources; acquired++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sources, acquired), &views[acquired], PyBUF_SIMPLE) < 0)
            goto done;
    const int32_t *which_at = which.buf;
    const int64_t *offset_at = offsets.buf;
    const uint8_t *flip_at = flips.buf;
    Py_ssize_t span = (size - 1) * stride + 3 * size; /* bytes from a crop's first pixel to past its last */
    for (Py_ssize_t k = first; k < last; k++) {      /* every read checked before any copy */
        if (which_at[k] < 0 || which_at[k] >= nsources || offset_at[k] < 0 ||
            offset_at[k] + span > views[which_at[k]].len) {
            PyErr_Format(PyExc_IndexError, "crop_batch: sample %zd reads past the end of source %d", k,
                         (int)which_at[k]);
            goto done;
        }
    }
    crop_job job = {out.buf, views, NULL, which_at, offset_at, flip_at, stride, size, span, sample_bytes, last, first,
                    0, -1, 0, 1};
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < acquired; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    if (out.obj) PyBuffer_Release(&out);
    if (which.obj) PyBuffer_Release(&which);
    if (offsets.obj) PyBuffer_Release(&offsets);
    if (flips.obj) PyBuffer_Release(&flips);
    Py_DECREF(sources);
    return result;
}

static PyObject *read_crops(PyObject *self, PyObject *args) {
    PyObject *out_obj, *maps_obj, *fds_obj, *which_obj, *offsets_obj, *flips_obj;
    Py_ssize_t stride, size, first, last, threads;
    int check = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOnnnnn|p", &out_obj, &maps_obj, &fds_obj, &which_obj, &offsets_obj, &flips_obj,
                          &stride, &size, &first, &last, &threads, &check))
        return NULL;
    if (size <= 0 || first < 0 || last < first || stride < 3 * size || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "read_crops: bad size, stride, sample range or thread count");
        return NULL;
    }
    PyObject *maps = PySequence_Fast(maps_obj, "read_crops: maps must be a sequence of buffers");
    if (maps == NULL) return NULL;
    Py_ssize_t nmaps = PySequence_Fast_GET_SIZE(maps);
    Py_buffer out = {0}, fds = {0}, which = {0}, offsets = {0}, flips = {0};
    Py_buffer *views = PyMem_Calloc((size_t)(nmaps > 0 ? nmaps : 1), sizeof(Py_buffer));
    Py_ssize_t sample_bytes = size * size * 3, span = (size - 1) * stride + 3 * size, acquired = 0;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (out.len < last * sample_bytes) {
        PyErr_Format(PyExc_ValueError, "read_crops: out holds %zd bytes, need %zd", out.len, last * sample_bytes);
        goto done;
    }
    if (get_array(fds_obj, &fds, 4, nmaps, "fds") < 0) goto done;
    if (get_array(which_obj, &which, 4, last, "which") < 0) goto done;
    if (get_array(offsets_obj, &offsets, 8, last, "offsets") < 0) goto done;
    if (get_array(flips_obj, &flips, 1, last, "flips") < 0) goto done;
    for (; acquired < nmaps; acquired++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(maps, acquired), &views[acquired], PyBUF_SIMPLE) < 0)
            goto done;
    crop_job job = {out.buf, views, fds.buf, which.buf, offsets.buf, flips.buf, stride, size, span, sample_bytes,
                    last, first, 0, -1, 0, check};
    for (Py_ssize_t k = first; k < last; k++) { /* every sample checked before any read */
        if (job.which_at[k] < 0 || job.which_at[k] >= nmaps || job.offset_at[k] < 0 ||
            job.offset_at[k] + span > views[job.which_at[k]].len) {
            PyErr_Format(PyExc_IndexError, "read_crops: sample %zd reads past the end of shard %d", k,
                         (int)job.which_at[k]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, threads);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nni", job.misses, job.failed, job.failed < 0 ? 0 : job.error);
done:
    for (Py_ssize_t i = 0; i < acquired; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    if (out.obj) PyBuffer_Release(&out);
    if (fds.obj) PyBuffer_Release(&fds);
    if (which.obj) PyBuffer_Release(&which);
    if (offsets.obj) PyBuffer_Release(&offsets);
    if (flips.obj) PyBuffer_Release(&flips);
    Py_DECREF(maps);
    return result;
}

static PyObject *uncached(PyObject *self, PyObject *args) {
    PyObject *maps_obj, *which_obj, *offsets_obj, *lengths_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &maps_obj, &which_obj, &offsets_obj, &lengths_obj)) return NULL;
    PyObject *maps = PySequence_Fast(maps_obj, "uncached: maps must be a sequence of buffers");
    if (maps == NULL) return NULL;
    Py_ssize_t nmaps = PySequence_Fast_GET_SIZE(maps), acquired = 0, count = 0, missing = 0, longest = 0;
    Py_buffer which = {0}, offsets = {0}, lengths = {0};
    Py_buffer *views = PyMem_Calloc((size_t)(nmaps > 0 ? nmaps : 1), sizeof(Py_buffer));
    unsigned char *vector = NULL;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(lengths_obj, &lengths, PyBUF_C_CONTIGUOUS) < 0) goto done;
    count = lengths.len / 8;
    if (get_array(which_obj, &which, 4, count, "which") < 0) goto done;
    if (get_array(offsets_obj, &offsets, 8, count, "offsets") < 0) goto done;
    for (; acquired < nmaps; acquired++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(maps, acquired), &views[acquired], PyBUF_SIMPLE) < 0)
            goto done;
    const int32_t *which_at = which.buf;
    const int64_t *offset_at = offsets.buf, *length_at = lengths.buf;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (which_at[k] < 0 || which_at[k] >= nmaps || offset_at[k] < 0 || length_at[k] < 0 ||
            offset_at[k] + length_at[k] > views[which_at[k]].len) {
            PyErr_Format(PyExc_IndexError, "uncached: sample %zd lies past the end of shard %d", k, (int)which_at[k]);
            goto done;
        }
        if (length_at[k] > longest) longest = length_at[k];
    }
    if ((vector = PyMem_Malloc((size_t)(longest / page_size + 2))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++)
        if (length_at[k] > 0 &&
            !resident((const uint8_t *)views[which_at[k]].buf + offset_at[k], length_at[k], vector))
            missing++;
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(missing);
done:
    for (Py_ssize_t i = 0; i < acquired; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(vector);
    if (which.obj) PyBuffer_Release(&which);
    if (offsets.obj) PyBuffer_Release(&offsets);
    if (lengths.obj) PyBuffer_Release(&lengths);
    Py_DECREF(maps);
    return result;
}

#if LOADOPT_SIMD
__attribute__((target("avx2,fma"))) static void normalise_avx2(float *out, const uint8_t *in, Py_ssize_t n,
                                                              const float scale[3], const float shift[3]) {
    /* 24 elements (8 pixels) a step: the channel pattern repeats every 3 vectors of 8 floats. */
    float s[24], t[24];
    for (int i = 0; i < 24; i++) {
        s[i] = scale[i % 3];
        t[i] = shift[i % 3];
    }
    __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8), s2 = _mm256_loadu_ps(s + 16);
    __m256 t0 = _mm256_loadu_ps(t), t1 = _mm256_loadu_ps(t + 8), t2 = _mm256_loadu_ps(t + 16);
    int stream = ((uintptr_t)out & 31) == 0;
    Py_ssize_t i = 0;
    for (; i + 24 <= n; i += 24) {
        __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + i))));
        __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + i + 8))));
        __m256 v2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + i + 16))));
        v0 = _mm256_fmadd_ps(v0, s0, t0);
        v1 = _mm256_fmadd_ps(v1, s1, t1);
        v2 = _mm256_fmadd_ps(v2, s2, t2);
        if (stream) {
            _mm256_stream_ps(out + i, v0);
            _mm256_stream_ps(out + i + 8, v1);
            _mm256_stream_ps(out + i + 16, v2);
        } else {
            _mm256_storeu_ps(out + i, v0);
            _mm256_storeu_ps(out + i + 8, v1);
            _mm256_storeu_ps(out + i + 16, v2);
        }
    }
    for (; i < n; i++) out[i] = fmaf((float)in[i], scale[i % 3], shift[i % 3]);
    _mm_sfence();
}
#endif

static PyObject *normalise(PyObject *self, PyObject *args) {
    PyObject *out_obj, *in_obj;
    float scale[3], shift[3];
    if (!PyArg_ParseTuple(args, "OO(fff)(fff)", &out_obj, &in_obj, &scale[0], &scale[1], &scale[2], &shift[0],
                          &shift[1], &shift[2]))
        return NULL;
#if LOADOPT_SIMD
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) Py_RETURN_FALSE;
    Py_buffer out = {0}, in = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (PyObject_GetBuffer(in_obj, &in, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (in.len % 3 != 0 || out.len != 4 * in.len) {
        PyErr_Format(PyExc_ValueError, "normalise: %zd input bytes (a multiple of 3) need %zd output bytes, got %zd",
                     in.len, 4 * in.len, out.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    normalise_avx2(out.buf, in.buf, in.len, scale, shift);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_True);
done:
    if (out.obj) PyBuffer_Release(&out);
    if (in.obj) PyBuffer_Release(&in);
    return result;
#else
    Py_RETURN_FALSE;
#endif
}

/* mirror(out, height, width): each of the `height` rows of `width` HWC uint8 pixels in the C-contiguous buffer
 * `out` mirrored left-right in place (a flipped crop resized into its slot): each row copied aside, then written
 * back mirrored by `copy_row`, 16 pixels a step where SIMD is built. Releases the GIL. */
static PyObject *mirror(PyObject *self, PyObject *args) {
    PyObject *out_obj;
    Py_ssize_t height, width;
    if (!PyArg_ParseTuple(args, "Onn", &out_obj, &height, &width)) return NULL;
    if (height < 0 || width <= 0) {
        PyErr_SetString(PyExc_ValueError, "mirror: bad height or width");
        return NULL;
    }
    Py_buffer out = {0};
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    Py_ssize_t row = 3 * width;
    if (out.len < height * row) {
        PyErr_Format(PyExc_ValueError, "mirror: out holds %zd bytes, need %zd", out.len, height * row);
        PyBuffer_Release(&out);
        return NULL;
    }
    uint8_t *aside = PyMem_RawMalloc((size_t)row);
    if (aside == NULL) {
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t y = 0; y < height; y++) {
        uint8_t *line = (uint8_t *)out.buf + y * row;
        memcpy(aside, line, (size_t)row);
        copy_row(line, aside, width, 1, 0);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(aside);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"normalise", normalise, METH_VARARGS, "uint8 HWC -> float32 (x * scale + shift per channel), one pass."},
    {"crop_batch", crop_batch, METH_VARARGS, "Crop (and mirror) stored HWC uint8 images into a batch."},
    {"mirror", mirror, METH_VARARGS, "Mirror each row of HWC uint8 pixels left-right, in place."},
    {"uncached", uncached, METH_VARARGS, "How many samples of mapped files are not all in the page cache."},
    {"read_crops", read_crops, METH_VARARGS, "Crop samples from mapped files where cached, else read through a scratch buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    init_masks();
#if LOADOPT_SIMD
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    page_size = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "SIMD", LOADOPT_SIMD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
