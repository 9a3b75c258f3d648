/* `float_kind`, shared by the compiled kernels (_fused.c, _pcg64.c): which float type a
 * buffer holds, from its struct format. Include after <Python.h>. */
#ifndef PS_TRANSPILER_FLOAT_KIND_H
#define PS_TRANSPILER_FLOAT_KIND_H

/* The element type of a buffer's struct format: 'f' or 'd' in native byte order ("<f" from
 * numpy's explicitly little-endian dtypes included), else 0. */
static char float_kind(const Py_buffer *view) {
    const char *format = view->format;
    if (format[0] == '@' || format[0] == '=') format++;
#if PY_LITTLE_ENDIAN
    else if (format[0] == '<') format++;
#else
    else if (format[0] == '>' || format[0] == '!') format++;
#endif
    if (format[1] != '\0') return 0;
    if (format[0] == 'f' && view->itemsize == 4) return 'f';
    if (format[0] == 'd' && view->itemsize == 8) return 'd';
    return 0;
}

#endif
