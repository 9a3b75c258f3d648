/* numpy's PCG64 uniform draws, without importing numpy.random (issue 30: what a process
 * imports stays resident for its whole run, and numpy.random is 2-3 MB of a pserver's peak
 * that only its startup's initializers use).
 *
 * `fill(state, out)` writes the numbers `Generator(PCG64(...)).random(n, dtype)` writes, in
 * the same order, and leaves `state` where numpy's generator would be:
 *
 *   state: 6 native uint64 words, [state_hi, state_lo, inc_hi, inc_lo, has_uint32, uinteger]
 *          (numpy's `bit_generator.state`: its 128-bit state and increment, and the buffered
 *          upper half of a 64-bit output that a float32 draw has not used yet);
 *   out:   a C-contiguous float32 or float64 buffer.
 *
 * As numpy (numpy/random/src/pcg64/pcg64.h, distributions.c): a step is
 * state = state * MULT + inc (mod 2^128), its output XSL-RR (the high and low halves xored,
 * rotated right by the top 6 bits); a float64 is (next64 >> 11) * 2^-53; a float32 is
 * (next32 >> 8) * 2^-24, where next32 is the low half of a fresh 64-bit output and, on the
 * next call, its buffered high half. ops/kernels/pcg64.py seeds the state as numpy's
 * SeedSequence does; tests/test_kernels_pcg64.py compares every step with numpy's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_float_kind.h"

#if !defined(__SIZEOF_INT128__)
#error "the PCG64 draws need a compiler with unsigned __int128"
#endif

typedef unsigned __int128 u128;

#define MULT (((u128)2549297995355413924ULL << 64) | 4865540595714422341ULL)

typedef struct {
    u128 state, inc;
    int has_uint32;
    uint32_t uinteger;
} pcg64;

static inline uint64_t next64(pcg64 *rng) {
    rng->state = rng->state * MULT + rng->inc;
    uint64_t folded = (uint64_t)(rng->state >> 64) ^ (uint64_t)rng->state;
    unsigned rot = (unsigned)(rng->state >> 122);
    return (folded >> rot) | (folded << ((-rot) & 63));
}

static inline uint32_t next32(pcg64 *rng) {
    if (rng->has_uint32) {
        rng->has_uint32 = 0;
        return rng->uinteger;
    }
    uint64_t next = next64(rng);
    rng->has_uint32 = 1;
    rng->uinteger = (uint32_t)(next >> 32);
    return (uint32_t)next;
}

static PyObject *pcg64_fill(PyObject *self, PyObject *args) {
    PyObject *state_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO:fill", &state_obj, &out_obj)) return NULL;
    Py_buffer state_view, out_view;
    if (PyObject_GetBuffer(state_obj, &state_view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(out_obj, &out_view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&state_view);
        return NULL;
    }
    PyObject *result = NULL;
    char kind = float_kind(&out_view);
    if (state_view.len != 6 * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "fill: the state is 6 uint64 words");
    } else if (kind == 0) {
        PyErr_SetString(PyExc_TypeError, "fill: out must be a C-contiguous float32 or float64 buffer");
    } else {
        uint64_t *words = state_view.buf;
        pcg64 rng = {((u128)words[0] << 64) | words[1], ((u128)words[2] << 64) | words[3], words[4] != 0,
                     (uint32_t)words[5]};
        Py_ssize_t n = out_view.len / out_view.itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (kind == 'f') {
            float *out = out_view.buf;
            for (Py_ssize_t i = 0; i < n; i++) out[i] = (float)(next32(&rng) >> 8) * (1.0f / 16777216.0f);
        } else {
            double *out = out_view.buf;
            for (Py_ssize_t i = 0; i < n; i++) out[i] = (double)(next64(&rng) >> 11) * (1.0 / 9007199254740992.0);
        }
        Py_END_ALLOW_THREADS
        words[0] = (uint64_t)(rng.state >> 64);
        words[1] = (uint64_t)rng.state;
        words[4] = (uint64_t)rng.has_uint32;
        words[5] = rng.uinteger;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&out_view);
    PyBuffer_Release(&state_view);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", pcg64_fill, METH_VARARGS,
     "fill(state, out): numpy's PCG64 uniform draws in [0, 1) into the float32/float64 buffer `out`, "
     "advancing `state` (6 uint64 words) as numpy's generator advances."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pcg64", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pcg64(void) { return PyModule_Create(&module); }
