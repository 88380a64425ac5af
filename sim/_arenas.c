/* Huge-page arenas for CPython's object allocator, for the simulator's process
 * (sim/arenas.py says why and when).
 *
 * pymalloc takes its memory in 1 MiB arenas, each a separate mmap, and gives an arena
 * back (munmap) once no object lives in it. This allocator carves the arenas out of one
 * reserved region advised MADV_HUGEPAGE (so the kernel backs it with 2 MiB pages: one
 * TLB entry where 512 were) and keeps an arena given back on a free list for the next
 * one (its pages stay mapped: no page faults, no zeroing). Anything else (another size,
 * the region used up, an arena from before the install) goes to the allocator that was
 * installed before. Memory given back is never returned to the system: the simulator's
 * heap only grows to its peak.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/mman.h>

#define ARENA ((size_t)1 << 20)  /* pymalloc's arena size (CPython 3.10+) */
#define HUGE_PAGE ((size_t)2 << 20)

static char *base, *next, *end;   /* the region; the next arena never handed out */
static void **free_list;          /* arenas given back, linked through their first word */
static PyObjectArenaAllocator previous;
static unsigned long long handed, reused, passed;

static void *arena_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size == ARENA) {
        if (free_list) {
            void **a = free_list;
            free_list = (void **)*a;
            reused++;
            return a;
        }
        if ((size_t)(end - next) >= size) {
            void *a = next;
            next += size;
            handed++;
            return a;
        }
    }
    passed++;
    return previous.alloc(previous.ctx, size);
}

static void arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    char *p = (char *)ptr;
    if (p >= base && p < end && size == ARENA) {
        *(void **)p = free_list;
        free_list = (void **)p;
        return;
    }
    previous.free(previous.ctx, ptr, size);
}

/* install(region_bytes) -> whether the kernel took the huge-page advice */
static PyObject *install(PyObject *self, PyObject *arg) {
    (void)self;
    size_t region = PyLong_AsSize_t(arg);
    if (region == (size_t)-1 && PyErr_Occurred()) return NULL;
    if (base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "huge-page arenas are installed already");
        return NULL;
    }
    region &= ~(HUGE_PAGE - 1);
    if (region < HUGE_PAGE) {
        PyErr_SetString(PyExc_ValueError, "the region must hold a huge page");
        return NULL;
    }
    /* reserved, not committed: pages are backed as the arenas are first touched */
    void *r = mmap(NULL, region + HUGE_PAGE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    base = next = (char *)(((uintptr_t)r + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    end = base + region;
    int advised = madvise(base, region, MADV_HUGEPAGE) == 0;  /* THP off: arenas still */
    PyObject_GetArenaAllocator(&previous);
    PyObjectArenaAllocator mine = {NULL, arena_alloc, arena_free};
    PyObject_SetArenaAllocator(&mine);
    return PyBool_FromLong(advised);
}

/* stats() -> (arenas handed out new, arenas reused, requests passed on) */
static PyObject *stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KKK)", handed, reused, passed);
}

static PyMethodDef methods[] = {
    {"install", install, METH_O, "Serves pymalloc's arenas from a huge-page region."},
    {"stats", stats, METH_NOARGS, "(handed out, reused, passed on)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_arenas", NULL, -1, methods};

PyMODINIT_FUNC PyInit__arenas(void) { return PyModule_Create(&module); }
