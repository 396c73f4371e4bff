/* The probe's timed random reads without the interpreter: one reader thread's batch of preads, each
 * timed, with the GIL released for the whole batch (as one fio psync job issues them). In Python, each
 * read cost a GIL hand-over and interpreter time: on a busy 2-core machine the probe read well
 * below fio's IOPS at 16 readers. Optional: without it, probe_readers reads in Python. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter_ns's clock on Linux */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, int writable,
                     const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (itemsize && (view->itemsize != itemsize || view->len < count * itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes", name, count, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* timed_reads(fds int32[n], offsets int64[n], lengths int64[n], buffer, latencies int64[n], end_ns, align)
 * -> (reads done, bytes, end time ns, errno of a failed read or 0).
 * Read i: pread of lengths[i] bytes (rounded up to 4096 when align, as O_DIRECT needs) at offsets[i]
 * from fds[i] into buffer; its nanoseconds go to latencies[i]. Stops after the read that ends at or
 * past end_ns, or at a failed read (not counted). */
static PyObject *timed_reads(PyObject *self, PyObject *args) {
    PyObject *fds_obj, *offsets_obj, *lengths_obj, *buffer_obj, *latencies_obj;
    long long end_ns;
    int align;
    if (!PyArg_ParseTuple(args, "OOOOOLp", &fds_obj, &offsets_obj, &lengths_obj, &buffer_obj, &latencies_obj,
                          &end_ns, &align))
        return NULL;
    Py_buffer fds, offsets, lengths, buffer, latencies;
    if (get_array(fds_obj, &fds, 4, 0, 0, "fds") < 0)
        return NULL;
    Py_ssize_t n = fds.len / 4;
    if (get_array(offsets_obj, &offsets, 8, n, 0, "offsets") < 0)
        goto fail_fds;
    if (get_array(lengths_obj, &lengths, 8, n, 0, "lengths") < 0)
        goto fail_offsets;
    if (get_array(buffer_obj, &buffer, 0, 0, 1, "buffer") < 0)
        goto fail_lengths;
    if (get_array(latencies_obj, &latencies, 8, n, 1, "latencies") < 0)
        goto fail_buffer;
    const int32_t *fd = fds.buf;
    const int64_t *offset = offsets.buf, *length = lengths.buf;
    int64_t *latency = latencies.buf;
    Py_ssize_t done = 0;
    long long nbytes = 0;
    int64_t ended = now_ns();
    int error = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (length[i] > buffer.len || (align && ((length[i] + 4095) & ~4095LL) > buffer.len)) {
            PyErr_SetString(PyExc_ValueError, "a read is longer than the buffer");
            goto fail_latencies;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t span = (size_t)(align ? ((length[i] + 4095) & ~4095LL) : length[i]);
        int64_t began = now_ns();
        ssize_t got = pread(fd[i], buffer.buf, span, (off_t)offset[i]);
        ended = now_ns();
        if (got < 0) {
            if (errno == EINTR) {
                i--;
                continue;
            }
            error = errno;
            break;
        }
        latency[i] = ended - began;
        nbytes += got < length[i] ? got : length[i];
        done++;
        if (ended >= end_ns)
            break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&latencies);
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&fds);
    return Py_BuildValue("nLLi", done, nbytes, (long long)ended, error);
fail_latencies:
    PyBuffer_Release(&latencies);
fail_buffer:
    PyBuffer_Release(&buffer);
fail_lengths:
    PyBuffer_Release(&lengths);
fail_offsets:
    PyBuffer_Release(&offsets);
fail_fds:
    PyBuffer_Release(&fds);
    return NULL;
}

static PyMethodDef methods[] = {
    {"timed_reads", timed_reads, METH_VARARGS, "A batch of timed preads with the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_preads", NULL, -1, methods};

PyMODINIT_FUNC PyInit__preads(void) { return PyModule_Create(&module); }
