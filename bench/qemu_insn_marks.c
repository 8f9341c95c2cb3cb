/* A qemu-user TCG plugin (plugin API 1, qemu 7.2) for bench/arm64_vs_llamacpp.py: counts the
 * aarch64 guest instructions executed, all of them and those of the "SIMD and floating-point
 * data processing" encoding class (the work of the vector pipes: sdot, shifts, fmla..., not
 * loads or stores), and at every getppid() syscall the guest makes, and at its exit, appends
 * the two counts so far ("ALL SIMD") to the file given as out=PATH. The guest marks the edges
 * of the work it measures with os.getppid(), so one process can count its load, prefill and
 * decode apart.
 * One counter for the process, added to inline per translation block: exact with one guest
 * thread (the benchmark runs both engines on one thread), racy with more. With blocks=PATH it
 * also writes, at exit, each translated block's guest address and the instructions it executed
 * after the first mark ("ADDR ALL SIMD", the address in hex), from which the benchmark makes a
 * profile by symbol of the work it measures (not of the start-up before it).
 *
 *   gcc -shared -fPIC -O2 -o insn_marks.so bench/qemu_insn_marks.c
 *   qemu-aarch64 -plugin ./insn_marks.so,out=/tmp/marks[,blocks=/tmp/blocks] -cpu cortex-a76 PROG
 *
 * The few declarations below are the plugin ABI's (qemu's include/qemu/qemu-plugin.h); Debian's
 * qemu-user ships the plugin loader but not the header. */
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t qemu_plugin_id_t;
typedef struct {
    const char *target_name;
    struct { int min, cur; } version;
    bool system_emulation;
    union { struct { int smp_vcpus, max_vcpus; } system; };
} qemu_info_t;
struct qemu_plugin_tb;
typedef void (*tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*syscall_cb_t)(qemu_plugin_id_t id, unsigned int vcpu, int64_t num, uint64_t a1,
                             uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6,
                             uint64_t a7, uint64_t a8);
enum { QEMU_PLUGIN_INLINE_ADD_U64 = 0 };
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, int op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const void *qemu_plugin_insn_data(const struct qemu_plugin_insn *insn);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, udata_cb_t cb, void *userdata);
void qemu_plugin_register_vcpu_syscall_cb(qemu_plugin_id_t id, syscall_cb_t cb);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

#define AARCH64_NR_GETPPID 173

static uint64_t executed, executed_simd;
static const char *out_path, *blocks_path;

/* blocks=: one record per translation (a block translated again gets another), in chunks that
 * never move, since the inline adds point into them; translation is serialized in user mode */
typedef struct { uint64_t vaddr, executed, executed_simd; } block_t;
enum { CHUNK = 1 << 16 };
static block_t **chunks;
static size_t n_blocks, n_chunks;

static block_t *new_block(uint64_t vaddr)
{
    if (n_blocks == n_chunks * CHUNK) {
        chunks = realloc(chunks, ++n_chunks * sizeof *chunks);
        chunks[n_chunks - 1] = calloc(CHUNK, sizeof(block_t));
    }
    block_t *b = &chunks[n_blocks / CHUNK][n_blocks % CHUNK];
    n_blocks++;
    b->vaddr = vaddr;
    return b;
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    const size_t n = qemu_plugin_tb_n_insns(tb);
    size_t simd = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t insn;
        memcpy(&insn, qemu_plugin_insn_data(qemu_plugin_tb_get_insn(tb, i)), 4);
        simd += ((insn >> 25) & 7) == 7;     /* op0 = x111: SIMD and FP data processing */
    }
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed, n);
    if (simd)
        qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed_simd,
                                                 simd);
    if (blocks_path) {
        block_t *b = new_block(qemu_plugin_tb_vaddr(tb));
        qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &b->executed, n);
        if (simd)
            qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64,
                                                     &b->executed_simd, simd);
    }
}

static void write_counts(void)
{
    FILE *f = fopen(out_path, "a");
    if (f) {
        fprintf(f, "%" PRIu64 " %" PRIu64 "\n", executed, executed_simd);
        fclose(f);
    }
}

static void at_exit(qemu_plugin_id_t id, void *userdata)
{
    (void)id; (void)userdata;
    write_counts();
    if (!blocks_path)
        return;
    FILE *f = fopen(blocks_path, "w");
    if (!f)
        return;
    for (size_t i = 0; i < n_blocks; i++) {
        const block_t *b = &chunks[i / CHUNK][i % CHUNK];
        if (b->executed)
            fprintf(f, "%" PRIx64 " %" PRIu64 " %" PRIu64 "\n", b->vaddr, b->executed,
                    b->executed_simd);
    }
    fclose(f);
}

static void on_syscall(qemu_plugin_id_t id, unsigned int vcpu, int64_t num, uint64_t a1,
                       uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6,
                       uint64_t a7, uint64_t a8)
{
    (void)id; (void)vcpu; (void)a1; (void)a2; (void)a3; (void)a4;
    (void)a5; (void)a6; (void)a7; (void)a8;
    if (num != AARCH64_NR_GETPPID)
        return;
    static int marks;
    if (marks++ == 0)
        for (size_t i = 0; i < n_blocks; i++)
            chunks[i / CHUNK][i % CHUNK].executed = chunks[i / CHUNK][i % CHUNK].executed_simd = 0;
    write_counts();
}

__attribute__((visibility("default")))
int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    (void)info;
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], "out=", 4) == 0)
            out_path = argv[i] + 4;
        else if (strncmp(argv[i], "blocks=", 7) == 0)
            blocks_path = argv[i] + 7;
    if (!out_path) {
        fprintf(stderr, "qemu_insn_marks: needs out=PATH\n");
        return 1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_vcpu_syscall_cb(id, on_syscall);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
