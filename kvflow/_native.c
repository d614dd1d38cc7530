/* kvflow._native: the loops a request runs through before it is routed, in C.
 *
 * Each computes exactly what its Python form computes (kvflow/tokenizer.py,
 * router/fingerprint.py, router/block_table.py), which stays as the fallback where no C compiler
 * built this module and as the specification the tests compare it with
 * (tests/router/test_native.py, tests/core/test_tokenizer.py). In Python each costs a string
 * object per word, or numpy's fixed cost per array operation (a prompt's few hundred blocks
 * need a dozen); one pass in C takes a third to a tenth of the time.
 *
 *   fingerprints(tokens, token_mix, k, parent, first_mix, later_mix) -> bytes | None
 *       Every full block's prefix fingerprint, as native-endian uint64s:
 *           m_i  = splitmix64(sum_j tokens_i[j] * token_mix[j] + (first_mix if i == 0 else later_mix))
 *           fp_i = fp_{i-1} * k + m_i,  fp_{-1} = parent          (all mod 2**64)
 *       None when a token is not an int (exactly) in the int64 range: every token is checked,
 *       the last partial block's too. The caller then converts the tokens as
 *       ``blockbytes.as_int64`` does (numpy integers count by their value) or refuses them.
 *
 *   find_prefix_runs(slots, keys, mixes, hashes, mul, shift) -> (found, runs)
 *       How many leading ``hashes`` an open-addressing table holds: ``slots`` (int32 record
 *       numbers, -1 empty, a power of two long), ``keys`` (uint64, the key of each record), a
 *       key's home slot ``(key * mul mod 2**64) >> shift``, probed linearly; the walk stops at
 *       the first key not in the table. ``runs``: ``(i, record)`` for the first key found and
 *       each later one whose record's ``mixes`` (uint32, one per record) differs from the one
 *       before, where a block's holders may change (router/block_table.py, ``BlockTable.match``).
 *
 *   probe_slots(slots, keys, hashes, mul, shift) -> (homes, slots)
 *       For each of a sequence of keys (ints below 2**64), its home slot in the same table, and
 *       ``_Slots.probe``'s answer: the slot holding its record, else the free slot where its
 *       record goes (a ValueError if the run has none: the table is full or names records past
 *       its keys).
 *
 *   tie_break(seed, k) -> int
 *       SplitMix64's ``k``-th output from ``seed`` (both taken mod 2**64): ``splitmix64(seed +
 *       (k + 1) * 0x9E3779B97F4A7C15)``, a picker's ``k``-th tie-break draw (router/framework.py).
 *
 *   WordIds(max_words): the built-in tokenizer's memo of words (kvflow/tokenizer.py,
 *   ``BuiltinTokenizer``), ASCII word -> token id, as a dict would hold it (``table[word] = id``,
 *   ``get``, ``len``, ``clear``; a full table forgets every word before it takes another), plus
 *       plain_words(chunk) -> (ids, missing) | None
 *           None unless ``chunk`` is plain text (ASCII letters, digits, '_' and single spaces);
 *           else ``chunk.split(" ")`` with every word after the first looked up: ``ids[0]`` is
 *           the first word itself, ``ids[i]`` the i-th word's id, or 0 for the words the table
 *           lacks, whose places ``missing`` lists.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t splitmix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* A token as uint64 (the int64's bits), or -1 with no exception set when it is not an int of
 * the int64 range. Only exact ints: converting any other object could run Python code, which
 * could change the list being read. */
static inline int token_value(PyObject *item, uint64_t *out) {
    int overflow = 0;
    if (!PyLong_CheckExact(item))
        return -1;
    /* Token ids are small: read an int of one machine digit in place, without the call that
     * converts any int (most of a prompt's cost was that call, once per token). */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *out = (uint64_t)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 0;
    }
#else
    Py_ssize_t digits = Py_SIZE(item);
    if (digits >= -1 && digits <= 1) {
        *out = (uint64_t)((int64_t)digits * (int64_t)((PyLongObject *)item)->ob_digit[0]);
        return 0;
    }
#endif
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *fingerprints(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_buffer mix;
    unsigned long long k, parent, first_mix, later_mix;
    if (!PyArg_ParseTuple(args, "Oy*KKKK", &tokens, &mix, &k, &parent, &first_mix, &later_mix))
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    Py_ssize_t block_size = mix.len / (Py_ssize_t)sizeof(uint64_t);
    if (block_size <= 0 || mix.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "token_mix must hold one uint64 per position in a block");
        goto done;
    }
    seq = PySequence_Fast(tokens, "tokens must be a sequence");
    if (seq == NULL)
        goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), n = count / block_size;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (result == NULL)
        goto done;
    const uint64_t *token_mix = (const uint64_t *)mix.buf;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(result), fp = parent, value;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t sum = i == 0 ? first_mix : later_mix;
        PyObject **block = items + i * block_size;
        for (Py_ssize_t j = 0; j < block_size; j++) {
            if (token_value(block[j], &value) < 0)
                goto not_int64;
            sum += value * token_mix[j];
        }
        fp = fp * k + splitmix64(sum);
        out[i] = fp;
    }
    for (Py_ssize_t j = n * block_size; j < count; j++)  /* the partial block: checked, not hashed */
        if (token_value(items[j], &value) < 0)
            goto not_int64;
    goto done;
not_int64:
    Py_CLEAR(result);
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&mix);
    return result;
}

/* A slot table as router/block_table.py keeps one (``_Slots``): ``slot`` holds record numbers
 * (-1: empty), ``key`` each record's key, a key's home is ``(key * mul mod 2**64) >> shift``. */
typedef struct {
    const int32_t *slot;
    const uint64_t *key;
    Py_ssize_t records;
    uint64_t mul, mask;
    int shift;
} SlotTable;

/* ``t`` over the buffers, or -1 with an exception set when they are not such a table. */
static int slot_table(SlotTable *t, const Py_buffer *slots, const Py_buffer *keys, uint64_t mul, int shift) {
    Py_ssize_t size = slots->len / 4;
    if (size <= 0 || (size & (size - 1)) || shift < 1 || shift > 63 || (((uint64_t)1 << (64 - shift)) != (uint64_t)size)) {
        PyErr_SetString(PyExc_ValueError, "slots must be a power of two long, with shift = 64 - log2(len(slots))");
        return -1;
    }
    *t = (SlotTable){slots->buf, keys->buf, keys->len / 8, mul, (uint64_t)size - 1, shift};
    return 0;
}

/* ``_Slots.probe``, the one probe loop: the slot of h's probe run that holds h's record, else the
 * slot the run ends at, empty where h's record goes. A run also ends at a slot naming a record
 * past the keys (never read) and once every slot was read (a full table). */
static inline uint64_t slot_probe(const SlotTable *t, uint64_t h) {
    uint64_t s = (h * t->mul) >> t->shift, probes = 1;
    int32_t r = t->slot[s];
    while (r >= 0 && r < t->records && t->key[r] != h && probes++ <= t->mask) {
        s = (s + 1) & t->mask;
        r = t->slot[s];
    }
    return s;
}

/* The record whose key is h, or -1. */
static inline int32_t slot_find(const SlotTable *t, uint64_t h) {
    int32_t r = t->slot[slot_probe(t, h)];
    return r >= 0 && r < t->records && t->key[r] == h ? r : -1;
}

static PyObject *probe_slots(PyObject *self, PyObject *args) {
    Py_buffer slots, keys;
    PyObject *hashes, *seq = NULL, *homes = NULL, *found = NULL, *result = NULL;
    unsigned long long mul;
    int shift;
    SlotTable t;
    if (!PyArg_ParseTuple(args, "y*y*OKi", &slots, &keys, &hashes, &mul, &shift))
        return NULL;
    if (slot_table(&t, &slots, &keys, mul, shift) < 0)
        goto done;
    seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    homes = PyList_New(n);
    found = PyList_New(n);
    if (homes == NULL || found == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = PyLong_AsUnsignedLongLong(items[i]);
        if (h == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        uint64_t s = slot_probe(&t, h);
        int32_t r = t.slot[s];
        if (r >= 0 && (r >= t.records || t.key[r] != h)) {
            PyErr_SetString(PyExc_ValueError, "a probe run ends at no free slot: the table is full or names records past its keys");
            goto done;
        }
        PyObject *home = PyLong_FromUnsignedLongLong((h * t.mul) >> t.shift), *at = PyLong_FromUnsignedLongLong(s);
        if (home == NULL || at == NULL) {
            Py_XDECREF(home);
            Py_XDECREF(at);
            goto done;
        }
        PyList_SET_ITEM(homes, i, home);
        PyList_SET_ITEM(found, i, at);
    }
    result = PyTuple_Pack(2, homes, found);
done:
    Py_XDECREF(seq);
    Py_XDECREF(homes);
    Py_XDECREF(found);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&keys);
    return result;
}

static PyObject *find_prefix_runs(PyObject *self, PyObject *args) {
    Py_buffer slots, keys, mixes, hashes;
    unsigned long long mul;
    int shift;
    if (!PyArg_ParseTuple(args, "y*y*y*y*Ki", &slots, &keys, &mixes, &hashes, &mul, &shift))
        return NULL;
    PyObject *runs = NULL, *result = NULL;
    Py_ssize_t n = hashes.len / 8, found = 0;
    SlotTable t;
    if (slot_table(&t, &slots, &keys, mul, shift) < 0)
        goto done;
    if (mixes.len / 4 < t.records) {
        PyErr_SetString(PyExc_ValueError, "mixes must hold a uint32 per key");
        goto done;
    }
    const uint32_t *mix = (const uint32_t *)mixes.buf;
    const uint64_t *hash = (const uint64_t *)hashes.buf;
    runs = PyList_New(0);
    if (runs == NULL)
        goto done;
    for (uint32_t last = 0; found < n; found++) {
        int32_t r = slot_find(&t, hash[found]);
        if (r < 0)
            break;
        if (found == 0 || mix[r] != last) {
            PyObject *run = Py_BuildValue("(ni)", found, r);
            if (run == NULL || PyList_Append(runs, run) < 0) {
                Py_XDECREF(run);
                goto done;
            }
            Py_DECREF(run);
            last = mix[r];
        }
    }
    result = Py_BuildValue("(nO)", found, runs);
done:
    Py_XDECREF(runs);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&mixes);
    PyBuffer_Release(&hashes);
    return result;
}

static PyObject *tie_break(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tie_break takes a seed and a draw number");
        return NULL;
    }
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[0]), k = PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(splitmix64(seed + (k + 1) * 0x9E3779B97F4A7C15ULL));
}

/* -- the built-in tokenizer's words ------------------------------------------------------ */

/* ASCII letters, digits, '_' and ' ': the characters of plain text (kvflow/tokenizer.py). */
static int plain_char[128];

#if PY_VERSION_HEX >= 0x030E0000
#define hash_bytes Py_HashBuffer
#else
#define hash_bytes _Py_HashBytes
#endif

/* WordIds: ASCII word -> token id, open addressing on the interpreter's keyed string hash (so a
 * client cannot pile words into one probe run), probed linearly, at most half full. Each slot
 * holds its word's bytes and its id, so a lookup reads one 32-byte slot and builds no object;
 * a word longer than WORD_BYTES is not kept (it is looked up in Python each time it comes). */
#define WORD_BYTES 18

typedef struct {
    Py_hash_t hash;
    uint32_t id;
    uint8_t used, length;
    char word[WORD_BYTES];
} WordSlot;

typedef struct {
    PyObject_HEAD
    WordSlot *slots;
    Py_ssize_t size, count, max_words;
} WordIds;

static int word_ids_init(WordIds *t, PyObject *args, PyObject *kwargs) {
    Py_ssize_t max_words;
    static char *names[] = {"max_words", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, &max_words))
        return -1;
    if (max_words < 1 || max_words > (1 << 26)) {
        PyErr_SetString(PyExc_ValueError, "max_words must be between 1 and 2**26");
        return -1;
    }
    if (t->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "WordIds is initialised once");
        return -1;
    }
    Py_ssize_t size = 16;
    while (size < 2 * max_words)
        size *= 2;
    t->slots = PyMem_Calloc((size_t)size, sizeof(WordSlot));
    if (t->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->size = size;
    t->max_words = max_words;
    t->count = 0;
    return 0;
}

static void word_ids_dealloc(WordIds *t) {
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* The slot holding ``word``, or the empty slot where it would go. */
static WordSlot *word_slot(const WordIds *t, const char *word, Py_ssize_t length, Py_hash_t hash) {
    size_t mask = (size_t)t->size - 1, s = (size_t)hash & mask;
    WordSlot *slot = t->slots + s;
    while (slot->used && !(slot->hash == hash && slot->length == length && memcmp(slot->word, word, (size_t)length) == 0)) {
        s = (s + 1) & mask;
        slot = t->slots + s;
    }
    return slot;
}

/* The slot holding ``word``, or NULL (a word too long to be kept is never held). */
static WordSlot *word_find(const WordIds *t, const char *word, Py_ssize_t length) {
    if (length > WORD_BYTES)
        return NULL;
    WordSlot *slot = word_slot(t, word, length, hash_bytes(word, length));
    return slot->used ? slot : NULL;
}

static Py_ssize_t word_ids_len(WordIds *t) { return t->count; }

/* table[word] = id: a word not yet known is added (a full table forgets every word first). */
static int word_ids_set(WordIds *t, PyObject *word, PyObject *id) {
    if (id == NULL) {
        PyErr_SetString(PyExc_TypeError, "WordIds forgets words only all at once (clear)");
        return -1;
    }
    if (!PyUnicode_Check(word) || !PyUnicode_IS_ASCII(word)) {
        PyErr_SetString(PyExc_TypeError, "WordIds keys are ASCII str words");
        return -1;
    }
    unsigned long value = PyLong_AsUnsignedLong(id);
    if (value == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (value == 0 || value > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "WordIds ids are between 1 and 2**32 - 1");
        return -1;
    }
    const char *bytes = (const char *)PyUnicode_1BYTE_DATA(word);
    Py_ssize_t length = PyUnicode_GET_LENGTH(word);
    if (length > WORD_BYTES)
        return 0;
    Py_hash_t hash = hash_bytes(bytes, length);
    WordSlot *slot = word_slot(t, bytes, length, hash);
    if (!slot->used) {
        if (t->count >= t->max_words) {  /* cheaper than LRU bookkeeping; common words come back at once */
            memset(t->slots, 0, (size_t)t->size * sizeof(WordSlot));
            t->count = 0;
            slot = word_slot(t, bytes, length, hash);
        }
        t->count++;
        slot->used = 1;
        slot->hash = hash;
        slot->length = (uint8_t)length;
        memcpy(slot->word, bytes, (size_t)length);
    }
    slot->id = (uint32_t)value;
    return 0;
}

static PyObject *word_ids_get(WordIds *t, PyObject *args) {
    PyObject *word, *fallback = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &word, &fallback))
        return NULL;
    if (PyUnicode_Check(word) && PyUnicode_IS_ASCII(word)) {
        WordSlot *slot = word_find(t, (const char *)PyUnicode_1BYTE_DATA(word), PyUnicode_GET_LENGTH(word));
        if (slot != NULL)
            return PyLong_FromUnsignedLong(slot->id);
    }
    return Py_NewRef(fallback);
}

static PyObject *word_ids_clear(WordIds *t, PyObject *unused) {
    memset(t->slots, 0, (size_t)t->size * sizeof(WordSlot));
    t->count = 0;
    Py_RETURN_NONE;
}

/* (ids, missing) for a plain chunk, None for any other (see the module's comment). */
static PyObject *word_ids_plain_words(WordIds *t, PyObject *chunk) {
    if (!PyUnicode_Check(chunk)) {
        PyErr_SetString(PyExc_TypeError, "plain_words takes a str");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(chunk))
        Py_RETURN_NONE;
    const char *text = (const char *)PyUnicode_1BYTE_DATA(chunk);
    Py_ssize_t length = PyUnicode_GET_LENGTH(chunk), parts = 1, first_end = -1;
    for (Py_ssize_t i = 0; i < length; i++) {
        if (!plain_char[(unsigned char)text[i]] || (text[i] == ' ' && i + 1 < length && text[i + 1] == ' '))
            Py_RETURN_NONE;
        if (text[i] == ' ') {
            parts++;
            if (first_end < 0)
                first_end = i;
        }
    }
    if (first_end < 0)
        first_end = length;
    PyObject *ids = PyList_New(parts), *missing = PyList_New(0), *first = NULL, *item;
    if (ids == NULL || missing == NULL)
        goto fail;
    if ((first = PyUnicode_FromStringAndSize(text, first_end)) == NULL)
        goto fail;
    PyList_SET_ITEM(ids, 0, first);
    Py_ssize_t start = first_end + 1, part = 1;
    for (Py_ssize_t i = start; part < parts; i++) {
        if (i < length && text[i] != ' ')
            continue;
        WordSlot *slot = word_find(t, text + start, i - start);
        if (slot != NULL) {
            item = PyLong_FromUnsignedLong(slot->id);
        } else {
            item = PyLong_FromLong(0);
            PyObject *at = PyLong_FromSsize_t(part);
            int failed = at == NULL || PyList_Append(missing, at) < 0;
            Py_XDECREF(at);
            if (failed) {
                Py_XDECREF(item);
                goto fail;
            }
        }
        if (item == NULL)
            goto fail;
        PyList_SET_ITEM(ids, part, item);
        part++;
        start = i + 1;
    }
    return Py_BuildValue("(NN)", ids, missing);
fail:
    Py_XDECREF(ids);  /* PyList_New filled it with NULLs: the unset places are skipped */
    Py_XDECREF(missing);
    return NULL;
}

static PyMethodDef word_ids_methods[] = {
    {"plain_words", (PyCFunction)word_ids_plain_words, METH_O, "A plain chunk's words looked up, or None."},
    {"get", (PyCFunction)word_ids_get, METH_VARARGS, "The id of a word, or the default."},
    {"clear", (PyCFunction)word_ids_clear, METH_NOARGS, "Forget every word."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods word_ids_mapping = {
    .mp_length = (lenfunc)word_ids_len,
    .mp_ass_subscript = (objobjargproc)word_ids_set,
};

static PyTypeObject WordIdsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._native.WordIds",
    .tp_doc = "ASCII word -> token id, for the built-in tokenizer (see the module's comment).",
    .tp_basicsize = sizeof(WordIds),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)word_ids_init,
    .tp_dealloc = (destructor)word_ids_dealloc,
    .tp_methods = word_ids_methods,
    .tp_as_mapping = &word_ids_mapping,
};

static PyMethodDef methods[] = {
    {"fingerprints", fingerprints, METH_VARARGS, "Every full block's prefix fingerprint (see the module's comment)."},
    {"tie_break", (PyCFunction)(void (*)(void))tie_break, METH_FASTCALL, "SplitMix64's k-th output for a seed."},
    {"probe_slots", probe_slots, METH_VARARGS, "Each key's home slot and the slot its probe run stops at."},
    {"find_prefix_runs", find_prefix_runs, METH_VARARGS, "How many leading keys a slot table holds, and where their records' mixes change."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvflow._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    for (int c = 0; c < 128; c++)
        plain_char[c] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == ' ';
    if (PyType_Ready(&WordIdsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "WordIds", (PyObject *)&WordIdsType) < 0)
        Py_CLEAR(m);
    return m;
}
