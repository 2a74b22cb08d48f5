/* One pass in C over a list of numpy arrays, where Python would touch each array a few
 * times per call (a call of a thousand gradients pays about 0.1 us per array per pass):
 * the arrays copied end to end into one flat array and back, the signature a plan is
 * found by, and the checks of an in-place call. A CPython extension, built at first use
 * against this Python's and this numpy's headers (mpigrad._base.native.extension); where
 * an array is not what a function handles, the function says so and its caller takes
 * numpy's way (mpigrad._base.array_lists). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

/* Whether ``item`` is a C-contiguous array of ``flat``'s dtype (writeable, if asked). */
static int copyable(PyObject *item, PyArrayObject *flat, int writeable) {
    if (!PyArray_Check(item))
        return 0;
    PyArrayObject *array = (PyArrayObject *)item;
    int flags = PyArray_FLAGS(array);
    if (!(flags & NPY_ARRAY_C_CONTIGUOUS) || (writeable && !(flags & NPY_ARRAY_WRITEABLE)))
        return 0;
    return PyArray_DESCR(array) == PyArray_DESCR(flat) ||
           PyArray_EquivTypes(PyArray_DESCR(array), PyArray_DESCR(flat));
}

/* The first of a call's two arguments (a sequence of arrays, an array) as a fast sequence
 * (a new reference); NULL, TypeError raised, where they are not such. */
static PyObject *sequence_of(PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyArray_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "expecting (a sequence of arrays, an array)");
        return NULL;
    }
    return PySequence_Fast(args[0], "expecting a sequence of arrays");
}

/* Copy the arrays of args[0] end to end into the array args[1] (``out``: the other way);
 * False, having copied nothing, where one is not copyable or the sizes differ. */
static PyObject *copy(PyObject *const *args, Py_ssize_t nargs, int out) {
    PyObject *seq = sequence_of(args, nargs);
    if (seq == NULL)
        return NULL;
    PyArrayObject *flat = (PyArrayObject *)args[1];
    int flags = PyArray_FLAGS(flat);
    if (!(flags & NPY_ARRAY_C_CONTIGUOUS) || (!out && !(flags & NPY_ARRAY_WRITEABLE))) {
        Py_DECREF(seq);
        Py_RETURN_FALSE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    npy_intp total = 0;
    int usable = 1;
    for (Py_ssize_t i = 0; usable && i < n; i++) {
        usable = copyable(items[i], flat, out);
        if (usable)
            total += PyArray_NBYTES((PyArrayObject *)items[i]);
    }
    usable = usable && total == PyArray_NBYTES(flat);
    char *at = PyArray_BYTES(flat);
    for (Py_ssize_t i = 0; usable && i < n; i++) {
        PyArrayObject *array = (PyArrayObject *)items[i];
        npy_intp nbytes = PyArray_NBYTES(array);
        /* memmove: an array may be the very slot of ``flat`` it is copied to or from */
        if (out)
            memmove(PyArray_BYTES(array), at, nbytes);
        else
            memmove(at, PyArray_BYTES(array), nbytes);
        at += nbytes;
    }
    Py_DECREF(seq);
    return PyBool_FromLong(usable);
}

static PyObject *gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return copy(args, nargs, 0);
}

static PyObject *scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return copy(args, nargs, 1);
}

/* a + b as numpy's np.add(a, b) gives it, NaN payloads too: where a is NaN, a's,
 * quieted (the hardware's rule for its first operand, which the compiler, taking addition
 * as commutative, may swap) */
#define ADD(type, bits, magnitude, infinity, quiet)                                         \
    static inline type add_##type(type a, type b) {                                         \
        type sum = a + b;                                                                   \
        bits x;                                                                             \
        memcpy(&x, &a, sizeof x);                                                           \
        if ((x & magnitude) > infinity) {                                                   \
            x |= quiet;                                                                     \
            memcpy(&sum, &x, sizeof x);                                                     \
        }                                                                                   \
        return sum;                                                                         \
    }
ADD(float, uint32_t, 0x7FFFFFFFu, 0x7F800000u, 0x00400000u)
ADD(double, uint64_t, 0x7FFFFFFFFFFFFFFFu, 0x7FF0000000000000u, 0x0008000000000000u)

/* out = rows[0] + rows[1] + ... in that order, element by element: each partial sum
 * rounded to the dtype, as numpy's adds one row after the other give it. */
#define ADD_ROWS(type)                                                                      \
    static void add_rows_##type(type *out, type *const *rows, Py_ssize_t n, npy_intp count) { \
        const type *first = rows[0];                                                        \
        if (n == 1) {                                                                       \
            memmove(out, first, (size_t)count * sizeof(type));                              \
            return;                                                                         \
        }                                                                                   \
        const type *second = rows[1];                                                       \
        for (npy_intp i = 0; i < count; i++)                                                \
            out[i] = add_##type(first[i], second[i]);                                       \
        for (Py_ssize_t k = 2; k < n; k++) {                                                \
            const type *row = rows[k];                                                      \
            for (npy_intp i = 0; i < count; i++)                                            \
                out[i] = add_##type(out[i], row[i]);                                        \
        }                                                                                   \
    }
ADD_ROWS(float)
ADD_ROWS(double)

/* The sum of the arrays of args[0] (rows: each of args[1]'s dtype and size, C-contiguous,
 * apart from it), in their order, into the array args[1]: floating-point (complex: its
 * parts) as numpy sums them, overflow and nan unreported (as MPI's sum); False, having
 * written nothing, where an array is not such (another dtype: the caller's numpy). */
static PyObject *add_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    PyObject *seq = sequence_of(args, nargs);
    if (seq == NULL)
        return NULL;
    PyArrayObject *out = (PyArrayObject *)args[1];
    int type = PyArray_TYPE(out);
    int single = type == NPY_FLOAT || type == NPY_CFLOAT;
    if (!(single || type == NPY_DOUBLE || type == NPY_CDOUBLE) ||
        !PyArray_ISCARRAY(out) || !PyArray_ISNOTSWAPPED(out)) {
        Py_DECREF(seq);
        Py_RETURN_FALSE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    char *lo = PyArray_BYTES(out), *hi = lo + PyArray_NBYTES(out);
    void *rows[64];
    int usable = n > 0 && n <= 64;
    for (Py_ssize_t k = 0; usable && k < n; k++) {
        PyArrayObject *row = (PyArrayObject *)items[k];
        usable = copyable(items[k], out, 0) && PyArray_NBYTES(row) == PyArray_NBYTES(out) &&
                 (PyArray_BYTES(row) >= hi || PyArray_BYTES(row) + PyArray_NBYTES(row) <= lo);
        if (usable)
            rows[k] = PyArray_BYTES(row);
    }
    if (usable) {        /* (the rows are held by ``seq`` until the sum is done) */
        npy_intp count = PyArray_NBYTES(out) /
                         (single ? (npy_intp)sizeof(float) : (npy_intp)sizeof(double));
        if (single)
            add_rows_float((float *)lo, (float *const *)rows, n, count);
        else
            add_rows_double((double *)lo, (double *const *)rows, n, count);
    }
    Py_DECREF(seq);
    return PyBool_FromLong(usable);
}

/* Whether a dtype's number, byte order and item size tell it from every other dtype:
 * numpy's numeric dtypes and the legacy user dtypes (bfloat16: a number of its own per
 * process); not the flexible or parametric ones (strings, structures, datetimes). */
static int signed_by_number(int type_num) {
    switch (type_num) {
    case NPY_BOOL: case NPY_BYTE: case NPY_UBYTE: case NPY_SHORT: case NPY_USHORT:
    case NPY_INT: case NPY_UINT: case NPY_LONG: case NPY_ULONG: case NPY_LONGLONG:
    case NPY_ULONGLONG: case NPY_HALF: case NPY_FLOAT: case NPY_DOUBLE: case NPY_LONGDOUBLE:
    case NPY_CFLOAT: case NPY_CDOUBLE: case NPY_CLONGDOUBLE:
        return 1;
    default:
        return type_num >= NPY_USERDEF;
    }
}

/* The signature of exactly-ndarray arrays: every array's dtype (number, byte order, item
 * size) and shape, as bytes (equal bytes: equal classes, dtypes and shapes); None where
 * one is not such an array or its dtype is not signed by number. */
static PyObject *signature_of(PyObject **items, Py_ssize_t n) {
    Py_ssize_t words = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(items[i]) != &PyArray_Type ||
            !signed_by_number(PyArray_TYPE((PyArrayObject *)items[i])))
            Py_RETURN_NONE;
        words += 2 + PyArray_NDIM((PyArrayObject *)items[i]);
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, words * (Py_ssize_t)sizeof(int64_t));
    if (key == NULL)
        return NULL;
    int64_t *word = (int64_t *)PyBytes_AS_STRING(key);
    *word++ = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyArrayObject *array = (PyArrayObject *)items[i];
        int ndim = PyArray_NDIM(array);
        *word++ = ((int64_t)PyArray_TYPE(array) << 16) |
                  ((int64_t)(unsigned char)PyArray_DESCR(array)->byteorder << 8) | ndim;
        *word++ = PyArray_ITEMSIZE(array);
        npy_intp *dims = PyArray_DIMS(array);
        for (int d = 0; d < ndim; d++)
            *word++ = dims[d];
    }
    return key;
}

/* Whether every array is writeable; None where one is not an array. */
static PyObject *writeable_of(PyObject **items, Py_ssize_t n) {
    PyObject *result = Py_True;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArray_Check(items[i]))
            Py_RETURN_NONE;
        if (!PyArray_ISWRITEABLE((PyArrayObject *)items[i]))
            result = Py_False;
    }
    Py_INCREF(result);
    return result;
}

/* Whether an object appears twice among ``n`` objects: an open-addressed table of their
 * addresses (-1: no memory). */
static int repeated(PyObject **items, Py_ssize_t n) {
    size_t size = 16;
    while (size < 2 * (size_t)n)
        size <<= 1;
    uintptr_t *table = PyMem_Calloc(size, sizeof(uintptr_t));
    if (table == NULL)
        return -1;
    int found = 0;
    for (Py_ssize_t i = 0; i < n && !found; i++) {
        uintptr_t object = (uintptr_t)items[i];
        size_t at = (size_t)((object >> 4) * 0x9E3779B97F4A7C15u) & (size - 1);
        while (table[at] != 0 && table[at] != object)
            at = (at + 1) & (size - 1);
        found = table[at] == object;
        table[at] = object;
    }
    PyMem_Free(table);
    return found;
}

/* Whether the arrays cannot share memory by how they were made: each owns its memory
 * (no base) and none is given twice; None where one is not an array. */
static PyObject *owned_apart_of(PyObject **items, Py_ssize_t n) {
    int owned = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArray_Check(items[i]))
            Py_RETURN_NONE;
        owned = owned && PyArray_BASE((PyArrayObject *)items[i]) == NULL;
    }
    if (!owned)
        Py_RETURN_FALSE;
    int twice = repeated(items, n);
    if (twice < 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(!twice);
}

/* Whether every item is exactly a numpy array (no subclass, no other object). */
static PyObject *exactly_numpy_of(PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (Py_TYPE(items[i]) != &PyArray_Type)
            Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* ``of`` over the items of the one argument, a sequence. */
static PyObject *over_items(PyObject *const *args, Py_ssize_t nargs,
                            PyObject *(*of)(PyObject **, Py_ssize_t)) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "expecting one argument, a sequence");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "expecting a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *result = of(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq));
    Py_DECREF(seq);
    return result;
}

#define OVER_ITEMS(name)                                                                    \
    static PyObject *name(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {      \
        (void)self;                                                                         \
        return over_items(args, nargs, name##_of);                                          \
    }
OVER_ITEMS(signature)
OVER_ITEMS(writeable)
OVER_ITEMS(owned_apart)
OVER_ITEMS(exactly_numpy)

#define METHOD(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
    METHOD(add_rows, "add_rows(rows, out): the rows summed in order into out; False if not"),
    METHOD(exactly_numpy, "exactly_numpy(items): whether every item is exactly a numpy array"),
    METHOD(gather, "gather(arrays, flat): the arrays end to end into flat; False where not done"),
    METHOD(scatter, "scatter(arrays, flat): flat end to end into the arrays; False where not done"),
    METHOD(signature, "signature(arrays): the arrays' dtypes and shapes as bytes, or None"),
    METHOD(writeable, "writeable(arrays): whether every array is writeable, or None"),
    METHOD(owned_apart, "owned_apart(arrays): whether each owns its memory, none twice, or None"),
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mpigrad_array_lists", NULL, -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_mpigrad_array_lists(void) {
    import_array();
    return PyModule_Create(&module);
}
