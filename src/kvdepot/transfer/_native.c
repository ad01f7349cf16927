/* kvdepot.transfer._native: a one-view block move's copy list, and the driver's batch call, in C.

Why: on a GPU host the first copies of a 256 KiB-block store reach the driver ~75 us after the
call, and ~30 us of that is listing the first 16 copies in Python and the ctypes call that hands
them over (issue 19, perf-notes seventeenth pass, run DC). The same loop in C takes a few
microseconds. It is optional: `plan.py` and `cuda_batch.py` do the same in Python where this
module is not built (no compiler at install time, or Python < 3.11), and tests check that both
give the same lists.

Built against the limited API of Python 3.11 (one abi3 binary for 3.11 and later).
*/
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_block_ids, *s_host, *s_first, *s_span, *s_data_ptr, *s_untyped_storage;

/* An int attribute or method result as int64; -1 with an exception set on failure (callers
   check PyErr_Occurred, as -1 may be a value). */
static int64_t as_i64(PyObject *value) {
    if (value == NULL)
        return -1;
    long long out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return out;
}

/* Chunk part ``c``'s host buffer address and its allocation's: its ``span`` (two ints, given by
   the host tier with the slot) or, where that is None, host.data_ptr() and
   host.untyped_storage().data_ptr(), which cost ~8 us each with the caches cold. */
static int host_addresses(PyObject *c, PyObject *host, int64_t *data, int64_t *alloc) {
    PyObject *span = PyObject_GetAttr(c, s_span);
    if (span == NULL)
        return -1;
    if (span != Py_None) {
        int ok = PyTuple_Check(span) && PyTuple_Size(span) == 2;
        if (ok) {
            *data = PyLong_AsLongLong(PyTuple_GetItem(span, 0));  /* borrowed */
            *alloc = *data == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(PyTuple_GetItem(span, 1));
        }
        Py_DECREF(span);
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "a chunk part's span must be None or (address, allocation)");
            return -1;
        }
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_DECREF(span);
    *data = as_i64(PyObject_CallMethodObjArgs(host, s_data_ptr, NULL));
    if (*data == -1 && PyErr_Occurred())
        return -1;
    PyObject *storage = PyObject_CallMethodObjArgs(host, s_untyped_storage, NULL);
    if (storage == NULL)
        return -1;
    *alloc = as_i64(PyObject_CallMethodObjArgs(storage, s_data_ptr, NULL));
    Py_DECREF(storage);
    return (*alloc == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int overflowed(void) {
    PyErr_SetString(PyExc_OverflowError, "a copy's address does not fit in 64 bits");
    return -1;
}

typedef struct {
    int64_t base, stride, seg, max_bytes;
    Py_ssize_t max_copies, count;
    int64_t taken, pool_end, host_end, last_alloc, noted;  /* noted: the last allocation put in hosts */
    int64_t *pool_at, *host_at, *sizes;
    PyObject *hosts;
} Lister;

/* hosts.setdefault(alloc, host), for a driver that checks each allocation is pinned. */
static int note_host(Lister *l, int64_t alloc, PyObject *host) {
    PyObject *key = PyLong_FromLongLong(alloc);
    if (key == NULL)
        return -1;
    int has = PyDict_Contains(l->hosts, key);
    if (has == 0)
        has = PyDict_SetItem(l->hosts, key, host);
    Py_DECREF(key);
    l->noted = alloc;
    return has < 0 ? -1 : 0;
}

/* Lists chunk ``c``'s blocks from ``k`` on; returns 1 if it stopped inside it (at ``*stop``),
   0 if it listed all of them, -1 on an error. The rules are `plan.head_list`'s. */
static int list_chunk(Lister *l, PyObject *c, Py_ssize_t k, Py_ssize_t *stop) {
    PyObject *ids = NULL, *host = NULL;
    int rc = -1;
    int64_t first, data, alloc;
    ids = PyObject_GetAttr(c, s_block_ids);
    host = ids ? PyObject_GetAttr(c, s_host) : NULL;
    if (host == NULL)
        goto done;
    first = as_i64(PyObject_GetAttr(c, s_first));
    if (first == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t n = PySequence_Size(ids);
    if (n < 0)
        goto done;
    if (k >= n) {
        rc = 0;
        goto done;
    }
    if (host_addresses(c, host, &data, &alloc) < 0)
        goto done;
    int64_t at;
    if (__builtin_mul_overflow(first + (int64_t)k, l->seg, &at) || __builtin_add_overflow(at, data, &at)) {
        overflowed();
        goto done;
    }
    int is_list = PyList_Check(ids);
    for (; k < n; k++) {
        int64_t block, here;
        if (is_list) {
            block = PyLong_AsLongLong(PyList_GetItem(ids, k));  /* borrowed */
        } else {
            block = as_i64(PySequence_GetItem(ids, k));
        }
        if (block == -1 && PyErr_Occurred())
            goto done;
        if (__builtin_mul_overflow(block, l->stride, &here) || __builtin_add_overflow(here, l->base, &here)) {
            overflowed();
            goto done;
        }
        int joins = here == l->pool_end && at == l->host_end && alloc == l->last_alloc;
        if (l->taken >= l->max_bytes || (!joins && l->count == l->max_copies)) {
            *stop = k;
            rc = 1;
            goto done;
        }
        if (joins) {
            l->sizes[l->count - 1] += l->seg;
        } else {
            if (alloc != l->noted && note_host(l, alloc, host) < 0)
                goto done;
            l->pool_at[l->count] = here;
            l->host_at[l->count] = at;
            l->sizes[l->count] = l->seg;
            l->count++;
        }
        l->pool_end = here + l->seg;
        l->host_end = at + l->seg;
        l->last_alloc = alloc;
        at += l->seg;
        l->taken += l->seg;
    }
    rc = 0;
done:
    Py_XDECREF(ids);
    Py_XDECREF(host);
    return rc;
}

/* The blocks of all chunks, or -1 with an exception set. */
static Py_ssize_t blocks_of(PyObject *copies, Py_ssize_t chunks) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < chunks; i++) {
        PyObject *c = PySequence_GetItem(copies, i);
        PyObject *ids = c ? PyObject_GetAttr(c, s_block_ids) : NULL;
        Py_XDECREF(c);
        if (ids == NULL)
            return -1;
        Py_ssize_t n = PySequence_Size(ids);
        Py_DECREF(ids);
        if (n < 0)
            return -1;
        total += n;
    }
    return total;
}

PyDoc_STRVAR(list_one_view_doc,
"list_one_view(base, stride, seg, copies, to_host, max_bytes, max_copies)\n"
"-> (table, address, count, taken, index, k, hosts)\n\n"
"The first copies of a one-view move, about ``max_bytes`` in at most ``max_copies`` copies,\n"
"merged as `plan._head_list_py` merges them: ``table`` (bytes) holds three rows of ``count``\n"
"int64 (destination, source, size) at ``address``; ``taken`` bytes; the first block not listed\n"
"(chunk ``index``'s ``k``-th); each host allocation met (address -> a tensor in it).");

static PyObject *list_one_view(PyObject *self, PyObject *args) {
    PyObject *copies, *result = NULL;
    long long base, stride, seg, max_bytes;
    Py_ssize_t index = 0, k = 0, max_copies;
    int to_host;
    if (!PyArg_ParseTuple(args, "LLLOpLn:list_one_view", &base, &stride, &seg, &copies, &to_host, &max_bytes,
                          &max_copies))
        return NULL;
    if (seg <= 0 || max_copies < 0) {
        PyErr_SetString(PyExc_ValueError, "seg must be > 0 and max_copies >= 0");
        return NULL;
    }
    Py_ssize_t chunks = PySequence_Size(copies);
    Py_ssize_t left = chunks < 0 ? -1 : blocks_of(copies, chunks);
    if (left < 0)
        return NULL;
    Py_ssize_t cap = left < max_copies ? left : max_copies;
    /* At most ``cap`` copies, the rows' length: even if a list grew while it was read (another
       thread, or Python code run by a tensor's method), nothing is written past them. */
    Lister l = {base, stride, seg, max_bytes, cap, 0, 0, -1, -1, -1, -1, NULL, NULL, NULL, NULL};
    int64_t *rows = PyMem_Malloc(sizeof(int64_t) * 3 * (cap ? cap : 1));
    l.hosts = PyDict_New();
    if (rows == NULL || l.hosts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    l.pool_at = rows;
    l.host_at = rows + cap;
    l.sizes = rows + 2 * cap;
    Py_ssize_t stop = 0;
    for (; index < chunks; index++, k = 0) {
        PyObject *c = PySequence_GetItem(copies, index);
        if (c == NULL)
            goto done;
        int rc = list_chunk(&l, c, k, &stop);
        Py_DECREF(c);
        if (rc < 0)
            goto done;
        if (rc == 1) {
            k = stop;
            break;
        }
    }
    if (index == chunks)
        k = 0;
    Py_ssize_t n = l.count;
    PyObject *table = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(int64_t) * 3 * n));
    if (table == NULL)
        goto done;
    char *out = PyBytes_AsString(table);
    int64_t *dst = to_host ? l.host_at : l.pool_at, *src = to_host ? l.pool_at : l.host_at;
    memcpy(out, dst, sizeof(int64_t) * n);
    memcpy(out + sizeof(int64_t) * n, src, sizeof(int64_t) * n);
    memcpy(out + 2 * sizeof(int64_t) * n, l.sizes, sizeof(int64_t) * n);
    result = Py_BuildValue("(NKnLnnO)", table, (unsigned long long)(n ? (uintptr_t)out : 0), n, (long long)l.taken,
                           index, k, l.hosts);
done:
    PyMem_Free(rows);
    Py_XDECREF(l.hosts);
    return result;
}

typedef int (*batch_fn)(void *, void *, void *, size_t, void *, void *, size_t, void *);

PyDoc_STRVAR(batch_call_doc,
"batch_call(fn, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream) -> int\n\n"
"Calls ``fn`` (the address of ``cuMemcpyBatchAsync_v2``) with these addresses and counts and\n"
"returns its CUresult: what the ctypes call in `cuda_batch` does (the GIL released during it),\n"
"without ctypes' per-argument conversions. The caller resolves ``fn`` from the driver; this\n"
"module links no CUDA.");

static PyObject *batch_call(PyObject *self, PyObject *args) {
    unsigned long long fn, dsts, srcs, sizes, attrs, idxs, stream;
    Py_ssize_t count, num_attrs;
    if (!PyArg_ParseTuple(args, "KKKKnKKnK:batch_call", &fn, &dsts, &srcs, &sizes, &count, &attrs, &idxs, &num_attrs,
                          &stream))
        return NULL;
    if (fn == 0 || count < 0 || num_attrs < 0) {
        PyErr_SetString(PyExc_ValueError, "fn must be an address, count and num_attrs >= 0");
        return NULL;
    }
    int rc;
    /* The driver spends ~0.5-1.7 us of host time per copy: other threads (the engine's step loop)
       run Python meanwhile, as they did beside the ctypes call, which releases the GIL too. */
    Py_BEGIN_ALLOW_THREADS
    rc = ((batch_fn)(uintptr_t)fn)((void *)(uintptr_t)dsts, (void *)(uintptr_t)srcs, (void *)(uintptr_t)sizes,
                                  (size_t)count, (void *)(uintptr_t)attrs, (void *)(uintptr_t)idxs,
                                  (size_t)num_attrs, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"list_one_view", list_one_view, METH_VARARGS, list_one_view_doc},
    {"batch_call", batch_call, METH_VARARGS, batch_call_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module) {
    s_block_ids = PyUnicode_InternFromString("block_ids");
    s_host = PyUnicode_InternFromString("host");
    s_first = PyUnicode_InternFromString("first");
    s_span = PyUnicode_InternFromString("span");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_untyped_storage = PyUnicode_InternFromString("untyped_storage");
    return (s_block_ids && s_host && s_first && s_span && s_data_ptr && s_untyped_storage) ? 0 : -1;
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_native", "One-view copy lists and the driver's batch call, in C (optional).",
    0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&module_def); }
