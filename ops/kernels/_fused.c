/* One-pass kernels for the optimizer updates numpy runs as a dozen array passes.
 *
 * `adam` computes, element by element, exactly the operations `_adam_dense` in
 * optimizers.py runs array by array, in the same order and at the same precision:
 *
 *     m1_out = m1 * beta1 + g * (1 - beta1)
 *     m2_out = m2 * beta2 + (g * (1 - beta2)) * g
 *     p_out  = p - (m1_out / (sqrt(m2_out) + eps_t)) * lr_t
 *
 * Each operation rounds to the array's precision (float or double) as numpy's does, so the
 * results are the same bits: the build passes -ffp-contract=off (no fused multiply-add) and
 * nothing here reassociates. Outputs may be the inputs themselves (a sync pserver updates its
 * param and moments in place): each block of elements is read before it is written.
 *
 * `sgd` computes `param = param - grad * lr` in place, one pass, as sgd's numpy path
 * (`np.multiply(grad, lr)`, then `np.subtract`) does in two with a temporary between.
 *
 * The loops release the GIL: a pserver's other RPC threads run while it updates.
 * Built as an optional extension (setup.py): without a C compiler the numpy path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "_float_kind.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* One build for any x86-64: an AVX2 copy of the loop where the CPU has it. */
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Blocks of BLOCK elements computed into local arrays, then copied out: the locals alias
 * nothing, so the compute loop vectorizes without runtime overlap checks, and an output
 * that is its own input (in place) is written only after its block was read. */
#define BLOCK 512

#define ADAM_LOOP(T, SQRT)                                                                      \
    VECTOR_CLONES static void adam_##T(const T *p, const T *g, const T *m1, const T *m2,       \
                                       T *p_out, T *m1_out, T *m2_out, Py_ssize_t n, T beta1,   \
                                       T beta2, T lr_t, T eps_t) {                              \
        const T c1 = (T)1 - beta1, c2 = (T)1 - beta2;                                           \
        T a[BLOCK], b[BLOCK], q[BLOCK];                                                         \
        for (Py_ssize_t base = 0; base < n; base += BLOCK) {                                    \
            Py_ssize_t len = n - base < BLOCK ? n - base : BLOCK;                               \
            const T *pb = p + base, *gb = g + base, *m1b = m1 + base, *m2b = m2 + base;         \
            for (Py_ssize_t i = 0; i < len; i++) {                                              \
                T gi = gb[i];                                                                   \
                a[i] = m1b[i] * beta1 + gi * c1;                                                \
                b[i] = m2b[i] * beta2 + (gi * c2) * gi;                                         \
                q[i] = pb[i] - (a[i] / (SQRT(b[i]) + eps_t)) * lr_t;                            \
            }                                                                                   \
            memcpy(m1_out + base, a, (size_t)len * sizeof(T));                                  \
            memcpy(m2_out + base, b, (size_t)len * sizeof(T));                                  \
            memcpy(p_out + base, q, (size_t)len * sizeof(T));                                   \
        }                                                                                       \
    }

ADAM_LOOP(float, sqrtf)
ADAM_LOOP(double, sqrt)

/* A C-contiguous view of `obj` (with its struct format, for `float_kind`), writable when asked. */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *fn, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a C-contiguous%s float buffer", fn, name,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static PyObject *fused_adam(PyObject *self, PyObject *args) {
    static const char *names[7] = {"param", "grad", "moment1", "moment2", "param_out", "moment1_out",
                                   "moment2_out"};
    PyObject *objs[7];
    double beta1, beta2, lr_t, eps_t;
    if (!PyArg_ParseTuple(args, "OOOOOOOdddd:adam", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &beta1, &beta2, &lr_t, &eps_t))
        return NULL;
    Py_buffer views[7];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 7; got++)
        if (get_buffer(objs[got], &views[got], got >= 4, "adam", names[got]) < 0) goto done;
    char kind = float_kind(&views[0]);
    Py_ssize_t itemsize = views[0].itemsize, size = views[0].len;
    if (kind == 0) {
        PyErr_SetString(PyExc_TypeError, "adam: param must be float32 or float64");
        goto done;
    }
    for (int i = 1; i < 7; i++) {
        if (float_kind(&views[i]) != kind || views[i].len != size) {
            PyErr_Format(PyExc_ValueError, "adam: %s differs from param in dtype or size", names[i]);
            goto done;
        }
    }
    Py_ssize_t n = size / itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        adam_float(views[0].buf, views[1].buf, views[2].buf, views[3].buf, views[4].buf, views[5].buf,
                   views[6].buf, n, (float)beta1, (float)beta2, (float)lr_t, (float)eps_t);
    else
        adam_double(views[0].buf, views[1].buf, views[2].buf, views[3].buf, views[4].buf, views[5].buf,
                    views[6].buf, n, beta1, beta2, lr_t, eps_t);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}

#define SGD_LOOP(T)                                                                              \
    VECTOR_CLONES static void sgd_##T(T *p, const T *g, Py_ssize_t n, T lr) {                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T step = g[i] * lr;                                                                 \
            p[i] = p[i] - step;                                                                 \
        }                                                                                       \
    }
SGD_LOOP(float)
SGD_LOOP(double)

static PyObject *fused_sgd(PyObject *self, PyObject *args) {
    PyObject *param_obj, *grad_obj;
    double lr;
    if (!PyArg_ParseTuple(args, "OOd:sgd", &param_obj, &grad_obj, &lr)) return NULL;
    Py_buffer param, grad;
    if (get_buffer(param_obj, &param, 1, "sgd", "param") < 0) return NULL;
    if (get_buffer(grad_obj, &grad, 0, "sgd", "grad") < 0) {
        PyBuffer_Release(&param);
        return NULL;
    }
    PyObject *result = NULL;
    char kind = float_kind(&param);
    if (kind == 0) {
        PyErr_SetString(PyExc_TypeError, "sgd: param must be float32 or float64");
    } else if (float_kind(&grad) != kind || grad.len != param.len) {
        PyErr_SetString(PyExc_ValueError, "sgd: grad differs from param in dtype or size");
    } else {
        Py_ssize_t n = param.len / param.itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (kind == 'f')
            sgd_float(param.buf, grad.buf, n, (float)lr);
        else
            sgd_double(param.buf, grad.buf, n, lr);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&grad);
    PyBuffer_Release(&param);
    return result;
}

static PyMethodDef methods[] = {
    {"adam", fused_adam, METH_VARARGS,
     "adam(param, grad, m1, m2, param_out, m1_out, m2_out, beta1, beta2, lr_t, eps_t): "
     "the dense Adam update in one pass; outputs may alias the inputs."},
    {"sgd", fused_sgd, METH_VARARGS,
     "sgd(param, grad, lr): param = param - grad * lr in place, one pass (lr rounded to param's dtype)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
