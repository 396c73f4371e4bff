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
 * header(data) -> (width, height)
 * decode_region(data, denom, left, top, right, bottom) -> bytearray
 *   the HWC RGB pixels of [left, right) x [top, bottom) of the image decoded at scale 1/denom
 *   (coordinates in the scaled image), (bottom - top) * (right - left) * 3 bytes.
 * Errors and libjpeg warnings (corrupt or truncated data) raise ValueError; the GIL is released
 * while decoding. Built only where libjpeg-turbo's headers are (setup.py: optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
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
    if (setjmp(err.escape)) {
        failed = 1;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, data.buf, (unsigned long)data.len);
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
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (failed || why != NULL) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "JPEG decode: %s", failed ? err.message : why);
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "(width, height) of a JPEG."},
    {"decode_region", decode_region, METH_VARARGS, "Decode one region of a JPEG at scale 1/denom: HWC RGB bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
