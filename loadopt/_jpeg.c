/* loadopt's JPEG region decoder: only the rows and columns a crop needs, optionally at a reduced DCT
 * scale, with libjpeg-turbo's partial-decode API (jpeg_crop_scanline, jpeg_skip_scanlines).
 *
 * Why: a RandomResizedCrop keeps 8-100% of the frame (about half on average), but a full decode
 * runs the IDCT, upsampling and colour conversion on every pixel. Rows above the crop are skipped
 * (entropy-decoded only), columns outside it are neither inverse-transformed nor converted, and
 * decoding stops after the crop's last row (nothing below it is read). At scale 1 the pixels equal a
 * full decode's (same library, ISLOW IDCT, fancy upsampling: what simplejpeg and PIL use by default).
 * A reduced scale (1/2, 1/4, 1/8) does the downscale inside the IDCT: other pixels, far less work.
 *
 * Rows above the crop are still entropy-decoded (a Huffman stream can only be read from its start or a
 * restart marker): 75% of a region decode's time on ~400 x 350 q90 photos. A JPEG whose restart
 * intervals tile its MCU rows (what `with_restarts` writes, losslessly) is read from the markers
 * around the crop only: the intervals that cover it, margins included, are cut out into a smaller
 * JPEG of the same coefficients (`sub_jpeg`), whose region is then decoded as above.
 *
 * header(data) -> (width, height)
 * decode_region(data, denom, left, top, right, bottom) -> bytearray
 *   the HWC RGB pixels of [left, right) x [top, bottom) of the image decoded at scale 1/denom
 *   (coordinates in the scaled image), (bottom - top) * (right - left) * 3 bytes.
 * with_restarts(data, interval_px) -> bytes or None
 *   the same coefficients (the same pixels, bit for bit), sequential with optimised Huffman tables and
 *   a restart marker every k MCUs, k the divisor of the MCUs per row nearest `interval_px` wide (one
 *   interval per row where the row's MCU count is prime); None for what it does not transcode (not a
 *   JPEG, not 1 or 3 components, damaged: the caller keeps the original bytes).
 * Errors and libjpeg warnings (corrupt or truncated data) raise ValueError; the GIL is released
 * while decoding. Built only where libjpeg-turbo's headers are (setup.py: optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr base;
    jmp_buf escape;
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->escape, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo); /* a warning: corrupt data; strict, as simplejpeg's default */
}

static PyObject *header(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    cinfo.err = jpeg_std_error(&err.base);
    err.base.error_exit = on_error;
    err.base.emit_message = on_message;
    err.message[0] = 0;
    if (setjmp(err.escape)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "JPEG header: %s", err.message);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    PyObject *result = Py_BuildValue("(II)", (unsigned)cinfo.image_width, (unsigned)cinfo.image_height);
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return result;
}

/* Where a sequential Huffman JPEG's parts are, read from its markers (no decoding). */
typedef struct {
    size_t sof;  /* offset of the SOF segment's 0xFF */
    size_t data; /* first byte of the entropy-coded data */
    unsigned width, height, restart, mcu_w, mcu_h;
} jpeg_layout;

/* 1 where the JPEG is baseline or extended sequential (Huffman, 8-bit), with one scan of every
 * component and a restart interval; its layout in `l`. */
static int read_layout(const unsigned char *p, size_t n, jpeg_layout *l) {
    if (n < 4 || p[0] != 0xFF || p[1] != 0xD8) return 0;
    size_t i = 2;
    int components = 0;
    l->restart = 0;
    l->sof = 0;
    while (i + 4 <= n) {
        if (p[i] != 0xFF) return 0;
        unsigned char m = p[i + 1];
        if (m == 0xFF) { /* fill byte */
            i++;
            continue;
        }
        size_t len = ((size_t)p[i + 2] << 8) | p[i + 3];
        if (len < 2 || i + 2 + len > n) return 0;
        const unsigned char *seg = p + i + 4; /* the segment after its length */
        if (m == 0xC0 || m == 0xC1) {
            if (len < 8 || seg[0] != 8) return 0;
            components = seg[5];
            if (components < 1 || len < 8 + 3 * (size_t)components) return 0;
            unsigned hmax = 1, vmax = 1;
            for (int c = 0; c < components; c++) {
                unsigned h = seg[7 + 3 * c] >> 4, v = seg[7 + 3 * c] & 15;
                if (h < 1 || v < 1) return 0;
                if (h > hmax) hmax = h;
                if (v > vmax) vmax = v;
            }
            l->sof = i;
            l->height = ((unsigned)seg[1] << 8) | seg[2];
            l->width = ((unsigned)seg[3] << 8) | seg[4];
            l->mcu_w = components == 1 ? 8 : 8 * hmax; /* one component: an MCU is one block */
            l->mcu_h = components == 1 ? 8 : 8 * vmax;
        } else if (m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            return 0; /* progressive, lossless, hierarchical or arithmetic-coded */
        } else if (m == 0xDD) {
            if (len < 4) return 0;
            l->restart = ((unsigned)seg[0] << 8) | seg[1];
        } else if (m == 0xDA) {
            if (l->sof == 0 || seg[0] != components) return 0; /* the first scan holds every component */
            l->data = i + 2 + len;
            return l->width > 0 && l->height > 0 && l->restart > 0;
        } else if (m == 0xD9) {
            return 0;
        }
        i += 2 + len;
    }
    return 0;
}

/* The part of a JPEG a region needs, as a JPEG of its own: where the restart intervals tile the MCU
 * rows, the intervals covering the region (in the image scaled by 1/denom) and a margin of 4 scaled
 * pixels (the chroma upsampling reads the next row and column) are copied, renumbered, behind the
 * original headers with the frame's size changed. Their coefficients are the original's (each
 * interval's DC prediction starts afresh), so the region's pixels are too. 1 and the new JPEG in
 * `*out` (malloc'd) with its origin in scaled pixels, or 0: nothing to skip, or a layout not cut here. */
static int sub_jpeg(const unsigned char *p, size_t n, int denom, int left, int top, int right, int bottom,
                    unsigned char **out, size_t *out_len, int *x0, int *y0) {
    jpeg_layout l = {0};
    if (!read_layout(p, n, &l)) return 0;
    size_t per_row = (l.width + l.mcu_w - 1) / l.mcu_w, rows = (l.height + l.mcu_h - 1) / l.mcu_h;
    if (per_row % l.restart) return 0; /* intervals straddle rows */
    size_t k = per_row / l.restart, span = (size_t)l.restart * l.mcu_w; /* intervals a row, pixels each */
    long margin = 4L * denom;
    long fl = (long)left * denom - margin, ft = (long)top * denom - margin;
    long fr = (long)right * denom + margin, fb = (long)bottom * denom + margin;
    if (fl < 0) fl = 0;
    if (ft < 0) ft = 0;
    if (fr > (long)l.width) fr = l.width;
    if (fb > (long)l.height) fb = l.height;
    if (fr <= fl || fb <= ft) return 0;
    size_t r0 = (size_t)ft / l.mcu_h, r1 = ((size_t)fb + l.mcu_h - 1) / l.mcu_h;
    size_t i0 = (size_t)fl / span, i1 = ((size_t)fr + span - 1) / span;
    if (r1 > rows) r1 = rows;
    if (i1 > k) i1 = k;
    if (r0 == 0 && i0 == 0 && i1 == k) return 0; /* whole rows from the top: the plain decode stops as early */
    size_t last = (r1 - 1) * k + (i1 - 1); /* the last interval needed */
    size_t *starts = malloc((last + 1) * sizeof(size_t)), *ends = malloc((last + 1) * sizeof(size_t));
    int found = 0;
    if (starts != NULL && ends != NULL) {
        size_t pos = l.data, g = 0;
        starts[0] = pos;
        while (pos < n) {
            const unsigned char *ff = memchr(p + pos, 0xFF, n - pos);
            if (ff == NULL || (size_t)(ff - p) + 1 >= n) break;
            size_t q = (size_t)(ff - p);
            unsigned char m = p[q + 1];
            if (m == 0x00 || m == 0xFF) { /* a stuffed 0xFF in the data, or fill before a marker */
                pos = q + (m == 0x00 ? 2 : 1);
                continue;
            }
            ends[g] = q;
            if (m < 0xD0 || m > 0xD7) { /* the scan's end (EOI): it must hold every interval needed */
                found = g == last;
                break;
            }
            if ((unsigned)(m - 0xD0) != (g & 7)) break; /* out of sequence: damaged, left to the decoder */
            if (g == last) {
                found = 1;
                break;
            }
            starts[++g] = pos = q + 2;
        }
    }
    unsigned char *q = NULL;
    size_t at = l.data;
    if (found) {
        size_t size = l.data + 2;
        for (size_t r = r0; r < r1; r++)
            for (size_t j = i0; j < i1; j++) size += ends[r * k + j] - starts[r * k + j] + 2;
        q = malloc(size);
    }
    if (q != NULL) {
        memcpy(q, p, l.data);
        size_t sub_h = (r1 * l.mcu_h < l.height ? r1 * l.mcu_h : l.height) - r0 * l.mcu_h;
        size_t sub_w = (i1 * span < l.width ? i1 * span : l.width) - i0 * span;
        q[l.sof + 5] = (unsigned char)(sub_h >> 8);
        q[l.sof + 6] = (unsigned char)(sub_h & 255);
        q[l.sof + 7] = (unsigned char)(sub_w >> 8);
        q[l.sof + 8] = (unsigned char)(sub_w & 255);
        unsigned count = 0;
        for (size_t r = r0; r < r1; r++) {
            for (size_t j = i0; j < i1; j++) {
                size_t g = r * k + j;
                memcpy(q + at, p + starts[g], ends[g] - starts[g]);
                at += ends[g] - starts[g];
                if (r + 1 < r1 || j + 1 < i1) { /* the next interval's marker, numbered in the new scan */
                    q[at++] = 0xFF;
                    q[at++] = (unsigned char)(0xD0 + (count++ & 7));
                }
            }
        }
        q[at++] = 0xFF;
        q[at++] = 0xD9;
    }
    free(starts);
    free(ends);
    if (q == NULL) return 0;
    *out = q;
    *out_len = at;
    *x0 = (int)(i0 * span / (size_t)denom);
    *y0 = (int)(r0 * l.mcu_h / (size_t)denom);
    return 1;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data;
    int denom, left, top, right, bottom;
    if (!PyArg_ParseTuple(args, "y*iiiii", &data, &denom, &left, &top, &right, &bottom)) return NULL;
    if (!(denom == 1 || denom == 2 || denom == 4 || denom == 8) || left < 0 || top < 0 || right <= left ||
        bottom <= top) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "decode_region: denom 1, 2, 4 or 8 and a non-empty region");
        return NULL;
    }
    int width = right - left, height = bottom - top;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)width * height * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    JSAMPLE *volatile row = NULL; /* volatile: set after setjmp, read after a longjmp */
    volatile int failed = 0;
    const char *volatile why = NULL;
    cinfo.err = jpeg_std_error(&err.base);
    err.base.error_exit = on_error;
    err.base.emit_message = on_message;
    err.message[0] = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Restart markers that tile the rows: only the intervals around the region are read (sub_jpeg). */
    const unsigned char *source = data.buf;
    size_t source_len = (size_t)data.len;
    unsigned char *part = NULL;
    size_t part_len = 0;
    int x0 = 0, y0 = 0;
    if (sub_jpeg(source, source_len, denom, left, top, right, bottom, &part, &part_len, &x0, &y0)) {
        source = part;
        source_len = part_len;
    }
    left -= x0, right -= x0, top -= y0, bottom -= y0; /* set before setjmp: not volatile */
    if (setjmp(err.escape)) {
        failed = 1;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, source, (unsigned long)source_len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = 1;
        cinfo.scale_denom = (unsigned)denom;
        cinfo.dct_method = JDCT_ISLOW;
        cinfo.do_fancy_upsampling = TRUE;
        jpeg_start_decompress(&cinfo);
        if (cinfo.output_components != 3) {
            why = "not convertible to RGB";
        } else if ((unsigned)right > cinfo.output_width || (unsigned)bottom > cinfo.output_height) {
            why = "region outside the (scaled) image";
        } else {
            /* The decoded columns start at an iMCU boundary at or before `left` and cover `right`. One
             * column more on each side: the outermost decoded columns' chroma is upsampled without
             * their outer neighbour (edge replication), which would change the crop's edge pixels. */
            int first = left > 0 ? left - 1 : 0, last = (unsigned)right < cinfo.output_width ? right + 1 : right;
            JDIMENSION x = (JDIMENSION)first, w = (JDIMENSION)(last - first);
            jpeg_crop_scanline(&cinfo, &x, &w);
            /* rec_outbuf_height rows a call (2 for 4:2:0): one row at a time makes the library upsample
             * into a spare row and copy it out */
            int block = cinfo.rec_outbuf_height > 0 && cinfo.rec_outbuf_height <= 16 ? cinfo.rec_outbuf_height : 1;
            row = malloc((size_t)w * 3 * (size_t)block);
            if (row == NULL) {
                why = "out of memory";
            } else {
                JSAMPROW rows[16];
                for (int i = 0; i < block; i++) rows[i] = (JSAMPROW)row + (size_t)i * w * 3;
                if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top) why = "truncated";
                size_t skip = (size_t)(left - (int)x) * 3, bytes = (size_t)width * 3;
                for (int y = 0; why == NULL && y < height;) {
                    JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, (JDIMENSION)block);
                    if (got == 0) {
                        why = "truncated";
                        break;
                    }
                    for (JDIMENSION i = 0; i < got && y < height; i++, y++)
                        memcpy(pixels + (size_t)y * bytes, rows[i] + skip, bytes);
                }
            }
        }
        jpeg_abort_decompress(&cinfo); /* the rows below the crop are never decoded */
    }
    jpeg_destroy_decompress(&cinfo);
    free((void *)row);
    free(part);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (failed || why != NULL) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "JPEG decode: %s", failed ? err.message : why);
        return NULL;
    }
    return out;
}

/* The restart interval, in MCUs, for rows of `per_row` MCUs `mcu_w` pixels wide: the divisor of
 * per_row (so the intervals tile each row) whose width is nearest `interval_px`; not 1 (a marker every
 * MCU keeps the decoder off its fast path) unless a row is one MCU. */
static unsigned restart_mcus(unsigned per_row, unsigned mcu_w, int interval_px) {
    unsigned best = per_row;
    long best_gap = labs((long)per_row * mcu_w - interval_px);
    for (unsigned d = 2; d < per_row; d++) {
        long gap = labs((long)d * mcu_w - interval_px);
        if (per_row % d == 0 && gap < best_gap) {
            best = d;
            best_gap = gap;
        }
    }
    return best;
}

static PyObject *with_restarts(PyObject *self, PyObject *args) {
    Py_buffer data;
    int interval_px;
    if (!PyArg_ParseTuple(args, "y*i", &data, &interval_px)) return NULL;
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    error_mgr err;
    unsigned char *buffer = NULL; /* jpeg_mem_dest's: its address escapes, so it is read from memory */
    unsigned long size = 0;
    volatile int failed = 0;
    src.err = dst.err = jpeg_std_error(&err.base);
    err.base.error_exit = on_error;
    err.base.emit_message = on_message; /* a warning (damaged data) fails: the caller keeps the original */
    err.message[0] = 0;
    Py_BEGIN_ALLOW_THREADS
    jpeg_create_decompress(&src);
    jpeg_create_compress(&dst);
    if (setjmp(err.escape)) {
        failed = 1;
    } else {
        jpeg_mem_src(&src, data.buf, (unsigned long)data.len);
        jpeg_read_header(&src, TRUE);
        if (src.num_components != 1 && src.num_components != 3) {
            failed = 1;
        } else {
            jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&src);
            jpeg_copy_critical_parameters(&src, &dst); /* sequential; the colour space's markers kept */
            dst.optimize_coding = TRUE;
            unsigned mcu_w = src.num_components == 1 ? 8 : 8 * (unsigned)src.max_h_samp_factor;
            dst.restart_interval = restart_mcus((src.image_width + mcu_w - 1) / mcu_w, mcu_w, interval_px);
            jpeg_mem_dest(&dst, &buffer, &size);
            jpeg_write_coefficients(&dst, coefficients);
            jpeg_finish_compress(&dst);
            jpeg_finish_decompress(&src);
        }
    }
    jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyObject *result = NULL;
    if (!failed && buffer != NULL) result = PyBytes_FromStringAndSize((const char *)buffer, (Py_ssize_t)size);
    free(buffer);
    if (failed) Py_RETURN_NONE;
    return result;
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "(width, height) of a JPEG."},
    {"decode_region", decode_region, METH_VARARGS, "Decode one region of a JPEG at scale 1/denom: HWC RGB bytes."},
    {"with_restarts", with_restarts, METH_VARARGS,
     "The same JPEG coefficients, sequential, with restart intervals that tile its MCU rows (None: not transcoded)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
