// The simulated device's runtime (turbo/backends/cuda_sim): device memory, kernel execution and
// the memory-access accounting behind launch records. Built once with g++ (build.py) and loaded
// RTLD_GLOBAL, so every kernel module built against shim.h resolves its hooks here.
//
// Memory: one arena reserved with mmap(MAP_NORESERVE); an allocation takes whole 4 KiB pages and
// is followed by an unowned guard page, so a per-page owner table answers "which allocation holds
// this byte" exactly, and an access past an allocation's end, into a guard page or into freed
// memory is caught before it happens.
//
// Accounting: kernel modules are compiled with -fsanitize=thread but linked without the TSan
// runtime: the compiler's instrumentation calls __tsan_readN / __tsan_writeN before every memory
// access it cannot prove local, and this file defines those hooks. For arena addresses a hook
// checks the access lies inside one live allocation and sets one bit per byte in a read or a
// write bitmap; after the launch the bits of the pages it touched are counted per allocation
// (exact unique bytes read and written by that launch) and cleared. Any other address must be
// the block's shared memory, a fiber stack, the launch's parameters or a registered host range;
// anything else (a null or wild pointer) ends the launch with CUDA_ERROR_ILLEGAL_ADDRESS.
//
// Execution: the blocks of a grid run one after another on the calling OS thread; the threads
// of a block are fibers (own small stack each) switched cooperatively at __syncthreads and at
// every warp operation (shuffle, ballot, vote, __syncwarp), never elsewhere, so plain code runs
// at native speed. A barrier or warp op that can never complete (a thread exited or waits
// elsewhere) is reported with the kernel's name instead of hanging.

#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <string>
#include <vector>

#define SIM_API extern "C" __attribute__((visibility("default")))
#define SIM_HIDDEN __attribute__((visibility("hidden")))

namespace {

const size_t PAGE = 4096;
const int ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_ILLEGAL_ADDRESS = 700, ERR_LAUNCH_TIMEOUT = 702,
          ERR_LAUNCH_FAILED = 719;

// ---- the arena -------------------------------------------------------------------------------

struct Alloc {
    uintptr_t base = 0, end = 0;  // [base, end): the bytes asked for (base page-aligned)
    size_t pages = 0;             // pages held, the guard page included
    bool live = false;
};

uint8_t* arena = nullptr;
size_t arena_size = 0, arena_pages = 0;
uint32_t* owner = nullptr;        // per page: allocation id, 0 = none
uint8_t* rbits = nullptr;         // 1 bit per arena byte: read by the current launch
uint8_t* wbits = nullptr;         // ... written
uint8_t* page_dirty = nullptr;    // per page: some bit set this launch
std::vector<uint32_t> dirty;      // those pages
std::vector<Alloc> allocs(1);     // by id; id 0 unused
std::vector<std::pair<size_t, size_t>> free_runs;  // (first page, pages)
size_t bump = 0;                  // first never-used page
uint64_t raw_read = 0, raw_written = 0;  // bytes accessed by the launch, repeats included

struct Range { uintptr_t lo, hi; };
std::vector<Range> host_ranges;   // cuMemHostRegister'd host memory (device-accessible)
std::vector<Range> module_ranges; // the kernel modules' own data: __shared__ statics, constants
Range stacks = {0, 0}, dyn_smem = {0, 0}, params_range = {0, 0};

std::string error_text;
int launch_error = 0;
bool accept_host = false;
// a launch that runs past its time (a block spinning on a flag a later block would set: blocks
// run one after another here) ends with CUDA_ERROR_LAUNCH_TIMEOUT; checked every 2^20 accesses
double timeout_s = 300.0, launch_deadline = 0.0;
uint64_t accesses = 0;

double now() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}  // sim_accept_host: any host address is device memory (tests on CPU tensors)

void* reserve(size_t n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
}

// ---- fibers ------------------------------------------------------------------------------------

struct Dim3 { unsigned x, y, z; };

enum State : uint8_t { RUN, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
    void* sp;
    Dim3 tid;
    State state;
    int line;                    // the __syncthreads line it waits at
    int op, arg, width;          // its pending warp op
    unsigned mask;
    unsigned long long value, result;
};

struct Warp {
    unsigned arrived = 0, mask = 0, done = 0;  // done: lanes that exited
    int op = -1;
};

const size_t STACK = 256 * 1024;  // per fiber, a guard page below it
std::vector<Fiber> fibers;
std::vector<Warp> warps;
uint8_t* stack_pool = nullptr;
size_t stack_slots = 0;
void* sched_sp = nullptr;
int cur = -1, nthreads = 0, done_count = 0, bar_count = 0, bar_line = -1;
Dim3 g_grid, g_block, g_bidx;
// the runnable fibers, first in first out: a fiber that blocks switches straight to the next one
// (one context switch, not two through the scheduler); the scheduler's own context runs only
// when nothing is runnable (the block is finished, or deadlocked) or a launch fails
std::vector<int> run_queue;
size_t rq_head = 0, rq_tail = 0;
void (*g_tramp)(void**) = nullptr;
void** g_args = nullptr;
const char* g_kernel = "";
uint8_t* g_smem = nullptr;

}  // namespace

extern "C" void sim_ctx_switch(void** save_sp, void* new_sp);
extern "C" SIM_HIDDEN void sim_fiber_start();
extern "C" SIM_HIDDEN void sim_fiber_main();

#if defined(__x86_64__)
// save the callee-saved registers, MXCSR and the x87 control word on this stack, store its
// pointer, load the other's and restore the same from it (the System V ABI's preserved state)
asm(R"(
.text
.globl sim_ctx_switch
.type sim_ctx_switch,@function
sim_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size sim_ctx_switch, .-sim_ctx_switch
.globl sim_fiber_start
.hidden sim_fiber_start
.type sim_fiber_start,@function
sim_fiber_start:
    andq $-16, %rsp
    call sim_fiber_main
    ud2
.size sim_fiber_start, .-sim_fiber_start
)");
#else
#error "the simulated device's fibers are written for x86-64"
#endif

namespace {

inline void make_runnable(int t) {
    fibers[t].state = RUN;
    run_queue[rq_tail] = t;
    rq_tail = rq_tail + 1 == run_queue.size() ? 0 : rq_tail + 1;
}

inline int next_runnable() {
    if (rq_head == rq_tail) return -1;
    const int t = run_queue[rq_head];
    rq_head = rq_head + 1 == run_queue.size() ? 0 : rq_head + 1;
    return t;
}

// the current fiber has stopped (blocked or exited): run the next one, or the scheduler
void switch_away() {
    const int self = cur, next = next_runnable();
    if (next < 0) {
        sim_ctx_switch(&fibers[self].sp, sched_sp);
    } else {
        cur = next;
        sim_ctx_switch(&fibers[self].sp, fibers[next].sp);
    }
}

void fail(int code, const std::string& what) {
    if (!launch_error) {
        launch_error = code;
        error_text = what;
    }
}

// the calling fiber can never go on: record the error and leave its stack for good
[[noreturn]] void abort_fiber(int code, const std::string& what) {
    fail(code, what);
    fibers[cur].state = DONE;
    sim_ctx_switch(&fibers[cur].sp, sched_sp);
    __builtin_unreachable();
}

std::string where() {
    char buf[160];
    const Fiber& f = fibers[cur];
    snprintf(buf, sizeof buf, "kernel %s, block (%u,%u,%u), thread (%u,%u,%u)", g_kernel, g_bidx.x, g_bidx.y,
             g_bidx.z, f.tid.x, f.tid.y, f.tid.z);
    return buf;
}

inline bool in(const Range& r, uintptr_t a, size_t n) { return a >= r.lo && a + n <= r.hi; }

inline void dirty_page(size_t p) {
    if (!page_dirty[p]) {
        page_dirty[p] = 1;
        dirty.push_back((uint32_t)p);
    }
}

inline void mark(uint8_t* bits, size_t off, size_t n) {
    if (n <= 16) {  // every load and store the instrumentation reports: one 32-bit word of bits
        uint32_t word;
        memcpy(&word, bits + (off >> 3), 4);
        word |= ((1u << n) - 1u) << (off & 7);
        memcpy(bits + (off >> 3), &word, 4);
        dirty_page(off >> 12);
        dirty_page((off + n - 1) >> 12);
        return;
    }
    while (n) {
        const size_t k = n < 16 ? n : 16;  // 16 bits shifted by up to 7: one 32-bit word
        uint32_t word;
        memcpy(&word, bits + (off >> 3), 4);
        word |= ((1u << k) - 1u) << (off & 7);
        memcpy(bits + (off >> 3), &word, 4);
        for (size_t p = off >> 12; p <= (off + k - 1) >> 12; ++p)
            if (!page_dirty[p]) {
                page_dirty[p] = 1;
                dirty.push_back((uint32_t)p);
            }
        off += k;
        n -= k;
    }
}

void bad_access(uintptr_t a, size_t n, bool write, const char* why) {
    char buf[200];
    snprintf(buf, sizeof buf, "%s of %zu bytes at 0x%lx (%s) in ", write ? "write" : "read", n, (unsigned long)a, why);
    abort_fiber(ERR_ILLEGAL_ADDRESS, std::string(buf) + where());
}

void check_time() {
    if (cur >= 0 && now() > launch_deadline) {
        char buf[200];
        snprintf(buf, sizeof buf, "ran past %.1f s (TURBO_CUDA_SIM_TIMEOUT; a spin on a flag another block sets? blocks "
                 "run one after another on the simulated device) in ", timeout_s);
        abort_fiber(ERR_LAUNCH_TIMEOUT, buf + where());
    }
}

__attribute__((always_inline)) inline void access(const void* p, size_t n, bool write) {
    const uintptr_t a = (uintptr_t)p;
    if (__builtin_expect((++accesses & ((1u << 20) - 1)) == 0, 0)) check_time();
    const size_t off = a - (uintptr_t)arena;
    if (off < arena_size) {
        const uint32_t id = owner[off >> 12];
        if (id == 0 || a + n > allocs[id].end)
            bad_access(a, n, write, id == 0 ? "no live allocation: freed or a guard page" : "past its allocation's end");
        mark(write ? wbits : rbits, off, n);
        (write ? raw_written : raw_read) += n;
        return;
    }
    if (cur < 0) return;  // not inside a launch (a module's constructor)
    // a fiber's locals and the shared memory first: nearly every access outside the arena
    if (in(stacks, a, n) || in(dyn_smem, a, n) || in(params_range, a, n)) return;
    for (const Range& r : module_ranges)
        if (in(r, a, n)) return;
    for (const Range& r : host_ranges)
        if (in(r, a, n)) return;
    if (accept_host && a >= 65536) return;
    bad_access(a, n, write, a < 65536 ? "a null pointer" : "not device memory");
}

// ---- warp operations ----------------------------------------------------------------------------

enum WarpOp { W_SYNC = 0, W_IDX, W_UP, W_DOWN, W_XOR, W_BALLOT, W_ANY, W_ALL };

void resolve_warp(int w) {
    Warp& wp = warps[w];
    const int base = w * 32;
    unsigned long long res[32];
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l)
        if ((wp.mask >> l & 1u) && fibers[base + l].value) ballot |= 1u << l;
    for (int l = 0; l < 32; ++l) {
        if (!(wp.mask >> l & 1u)) continue;
        const Fiber& f = fibers[base + l];
        const int width = f.width, seg = l & ~(width - 1);
        int src = l;
        switch (f.op) {
            case W_IDX: src = seg + (f.arg & (width - 1)); break;
            case W_UP: src = l - f.arg >= seg ? l - f.arg : l; break;
            case W_DOWN: src = l + f.arg < seg + width ? l + f.arg : l; break;
            case W_XOR: src = ((l ^ f.arg) & ~(width - 1)) == seg ? (l ^ f.arg) : l; break;
            default: break;
        }
        if (f.op >= W_IDX && f.op <= W_XOR) {
            if (!(wp.mask >> src & 1u)) {
                char buf[160];
                snprintf(buf, sizeof buf, "warp shuffle: lane %d reads lane %d, outside the mask 0x%08x, in ", l, src,
                         wp.mask);
                cur = base + l;
                abort_fiber(ERR_LAUNCH_FAILED, buf + where());
            }
            res[l] = fibers[base + src].value;
        } else if (f.op == W_BALLOT) {
            res[l] = ballot;
        } else if (f.op == W_ANY) {
            res[l] = ballot != 0;
        } else if (f.op == W_ALL) {
            res[l] = ballot == wp.mask;
        } else {
            res[l] = 0;
        }
    }
    for (int l = 0; l < 32; ++l)
        if (wp.mask >> l & 1u) {
            fibers[base + l].result = res[l];
            if (base + l == cur) fibers[cur].state = RUN;  // the last to arrive goes on at once
            else make_runnable(base + l);
        }
    wp.arrived = 0;
    wp.mask = 0;
    wp.op = -1;
}

std::string lanes(unsigned m) {
    char buf[16];
    snprintf(buf, sizeof buf, "0x%08x", m);
    return buf;
}

}  // namespace

// ---- what kernel modules call (shim.h) ------------------------------------------------------------

SIM_API Dim3 sim_thread_idx() { return fibers[cur].tid; }
SIM_API Dim3 sim_block_idx() { return g_bidx; }
SIM_API Dim3 sim_block_dim() { return g_block; }
SIM_API Dim3 sim_grid_dim() { return g_grid; }
SIM_API void* sim_dyn_smem() { return g_smem; }

int bar_result = 0;  // __syncthreads_count's count, read by each waiter before the next barrier can complete

// __syncthreads; with op 1/2/3 also __syncthreads_count / _and / _or of `pred` (the result)
SIM_API int sim_syncthreads_op(int line, int op, int pred) {
    Fiber& f = fibers[cur];
    if (done_count > 0)
        abort_fiber(ERR_LAUNCH_FAILED, "__syncthreads (line " + std::to_string(line) + ") not reached by all threads: " +
                                           std::to_string(done_count) + " of the block's threads have exited; " + where());
    if (bar_count > 0 && line != bar_line)
        abort_fiber(ERR_LAUNCH_FAILED, "divergent __syncthreads: threads wait at line " + std::to_string(bar_line) +
                                           " and at line " + std::to_string(line) + "; " + where());
    bar_line = line;
    f.state = AT_BARRIER;
    f.line = line;
    f.value = pred != 0;
    if (++bar_count == nthreads) {
        int count = 0;
        for (int t = 0; t < nthreads; ++t) count += (int)fibers[t].value;
        bar_result = op == 1 ? count : op == 2 ? count == nthreads : op == 3 ? count > 0 : 0;
        for (int t = 0; t < nthreads; ++t)
            if (t != cur && fibers[t].state == AT_BARRIER) make_runnable(t);
        f.state = RUN;  // the last to arrive goes on at once
        bar_count = 0;
        bar_line = -1;
        return bar_result;
    }
    switch_away();
    return bar_result;
}

SIM_API void sim_syncthreads(int line) { sim_syncthreads_op(line, 0, 0); }

SIM_API unsigned long long sim_warp_op(int op, unsigned mask, unsigned long long value, int arg, int width) {
    Fiber& f = fibers[cur];
    const int lane = cur & 31, w = cur >> 5;
    if (width <= 0 || width > 32 || (width & (width - 1)))
        abort_fiber(ERR_LAUNCH_FAILED, "warp op with width " + std::to_string(width) + " (a power of 2 up to 32); " + where());
    if (!(mask >> lane & 1u))
        abort_fiber(ERR_LAUNCH_FAILED, "warp op called by lane " + std::to_string(lane) + " outside its mask " +
                                           lanes(mask) + "; " + where());
    const int warp_lanes = std::min(32, nthreads - w * 32);
    const unsigned exists = warp_lanes == 32 ? 0xffffffffu : ((1u << warp_lanes) - 1u);
    if (mask & ~exists)
        abort_fiber(ERR_LAUNCH_FAILED, "warp op mask " + lanes(mask) + " names lanes the block does not have; " + where());
    Warp& wp = warps[w];
    if (wp.op >= 0 && (wp.mask != mask || wp.op != op))
        abort_fiber(ERR_LAUNCH_FAILED, "divergent warp ops: lanes wait at different shuffles/votes (masks " + lanes(wp.mask) +
                                           " and " + lanes(mask) + "); " + where());
    if (mask & wp.done)
        abort_fiber(ERR_LAUNCH_FAILED, "warp op with mask " + lanes(mask) + " but lane " +
                                           std::to_string(__builtin_ctz(mask & wp.done)) + " has exited; " + where());
    wp.op = op;
    wp.mask = mask;
    wp.arrived |= 1u << lane;
    f.state = AT_WARP;
    f.op = op;
    f.arg = arg;
    f.width = width;
    f.value = value;
    if (wp.arrived == mask) {
        resolve_warp(w);
        return f.result;
    }
    switch_away();
    return fibers[cur].result;
}

extern "C" SIM_HIDDEN void sim_fiber_main() {
    g_tramp(g_args);
    Fiber& f = fibers[cur];
    f.state = DONE;
    ++done_count;
    if (bar_count > 0)
        fail(ERR_LAUNCH_FAILED, "__syncthreads (line " + std::to_string(bar_line) +
                                    ") not reached by all threads: a thread exited while others wait; " + where());
    const int w = cur >> 5;
    warps[w].done |= 1u << (cur & 31);
    if (warps[w].op >= 0 && (warps[w].mask >> (cur & 31) & 1u))
        fail(ERR_LAUNCH_FAILED, "warp op with mask " + lanes(warps[w].mask) + " not reached by lane " +
                                    std::to_string(cur & 31) + ", which exited; " + where());
    if (launch_error) sim_ctx_switch(&f.sp, sched_sp);
    switch_away();
    __builtin_unreachable();
}

// ---- the TSan instrumentation's hooks --------------------------------------------------------------

#define SIM_HOOKS(N)                                                                              \
    SIM_API void __tsan_read##N(void* p) { access(p, N, false); }                                 \
    SIM_API void __tsan_write##N(void* p) { access(p, N, true); }                                 \
    SIM_API void __tsan_unaligned_read##N(void* p) { access(p, N, false); }                       \
    SIM_API void __tsan_unaligned_write##N(void* p) { access(p, N, true); }                       \
    SIM_API void __tsan_volatile_read##N(void* p) { access(p, N, false); }                        \
    SIM_API void __tsan_volatile_write##N(void* p) { access(p, N, true); }
SIM_HOOKS(1)
SIM_HOOKS(2)
SIM_HOOKS(4)
SIM_HOOKS(8)
SIM_HOOKS(16)
SIM_API void __tsan_read_range(void* p, size_t n) { access(p, n, false); }
SIM_API void __tsan_write_range(void* p, size_t n) { access(p, n, true); }
SIM_API void __tsan_init() {}
SIM_API void __tsan_func_entry(void*) {}
SIM_API void __tsan_func_exit() {}
SIM_API void __tsan_vptr_update(void*, void*) {}
SIM_API void __tsan_vptr_read(void*) {}

// ---- what the Python driver calls --------------------------------------------------------------------

SIM_API int sim_init(size_t bytes) {
    if (arena) return 0;
    bytes = (bytes + PAGE - 1) / PAGE * PAGE;
    for (; bytes >= ((size_t)1 << 30); bytes /= 2) {
        arena = (uint8_t*)reserve(bytes);
        if (!arena) continue;
        owner = (uint32_t*)reserve(bytes / PAGE * sizeof(uint32_t));
        rbits = (uint8_t*)reserve(bytes / 8 + 8);
        wbits = (uint8_t*)reserve(bytes / 8 + 8);
        page_dirty = (uint8_t*)reserve(bytes / PAGE);
        if (owner && rbits && wbits && page_dirty) break;
        munmap(arena, bytes);
        arena = nullptr;
    }
    if (!arena) return ERR_OUT_OF_MEMORY;
    arena_size = bytes;
    arena_pages = bytes / PAGE;
    bump = 1;  // page 0 stays unowned: no allocation starts at the arena's first byte
    return 0;
}

SIM_API uintptr_t sim_arena_base() { return (uintptr_t)arena; }
SIM_API size_t sim_arena_size() { return arena_size; }

SIM_API uintptr_t sim_alloc(size_t n, int poison) {
    if (!arena || n == 0) return 0;
    const size_t need = (n + PAGE - 1) / PAGE + 1;  // + the guard page
    size_t first = 0;
    bool found = false;
    for (size_t i = 0; i < free_runs.size(); ++i) {
        if (free_runs[i].second >= need) {
            first = free_runs[i].first;
            free_runs[i].first += need;
            free_runs[i].second -= need;
            if (free_runs[i].second == 0) free_runs.erase(free_runs.begin() + i);
            found = true;
            break;
        }
    }
    if (!found) {
        if (bump + need > arena_pages) return 0;
        first = bump;
        bump += need;
    }
    const uint32_t id = (uint32_t)allocs.size();
    Alloc a;
    a.base = (uintptr_t)arena + first * PAGE;
    a.end = a.base + n;
    a.pages = need;
    a.live = true;
    allocs.push_back(a);
    for (size_t p = first; p < first + need - 1; ++p) owner[p] = id;
    owner[first + need - 1] = 0;
    // fresh device memory is not zeroed on a GPU: fill it with 0xff bytes (NaN as floats, -1 as
    // ints) so a kernel that reads what nobody wrote shows it
    if (poison) memset((void*)a.base, 0xff, n);
    return a.base;
}

SIM_API int sim_free(uintptr_t p) {
    const size_t off = p - (uintptr_t)arena;
    if (!arena || off >= arena_size) return ERR_INVALID_VALUE;
    const uint32_t id = owner[off / PAGE];
    if (id == 0 || allocs[id].base != p || !allocs[id].live) return ERR_INVALID_VALUE;
    Alloc& a = allocs[id];
    a.live = false;
    const size_t first = off / PAGE;
    for (size_t q = first; q < first + a.pages; ++q) owner[q] = 0;
    madvise((void*)a.base, (a.pages - 1) * PAGE, MADV_DONTNEED);
    free_runs.push_back({first, a.pages});
    return 0;
}

// the live allocation holding [p, p + n): its id and base (0 when there is none)
SIM_API uint32_t sim_find(uintptr_t p, size_t n, uintptr_t* base, size_t* size) {
    const size_t off = p - (uintptr_t)arena;
    if (!arena || off >= arena_size) return 0;
    const uint32_t id = owner[off / PAGE];
    if (id == 0 || p + n > allocs[id].end) return 0;
    if (base) *base = allocs[id].base;
    if (size) *size = allocs[id].end - allocs[id].base;
    return id;
}

SIM_API void sim_register_host(uintptr_t p, size_t n) { host_ranges.push_back({p, p + n}); }

SIM_API int sim_unregister_host(uintptr_t p) {
    for (size_t i = 0; i < host_ranges.size(); ++i)
        if (host_ranges[i].lo == p) {
            host_ranges.erase(host_ranges.begin() + i);
            return 0;
        }
    return ERR_INVALID_VALUE;
}

namespace {
int add_segments(struct dl_phdr_info* info, size_t, void* data) {
    if (info->dlpi_addr != (uintptr_t)data) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD) continue;
        const Range seg{info->dlpi_addr + ph.p_vaddr, info->dlpi_addr + ph.p_vaddr + ph.p_memsz};
        // once: a module loaded again (every cuModuleLoad of a library already mapped) adds nothing,
        // or the list -- walked on every access outside the arena -- grows with every load
        if (std::none_of(module_ranges.begin(), module_ranges.end(),
                         [&](const Range& r) { return r.lo == seg.lo && r.hi == seg.hi; }))
            module_ranges.push_back(seg);
    }
    return 1;
}
}  // namespace

// a kernel module's loaded segments (its __shared__ and __constant__ statics) are legal memory
SIM_API int sim_register_module(void* any_symbol) {
    Dl_info info;
    if (!dladdr(any_symbol, &info)) return ERR_INVALID_VALUE;
    dl_iterate_phdr(add_segments, info.dli_fbase);
    return 0;
}

SIM_API const char* sim_error() { return error_text.c_str(); }

SIM_API void sim_accept_host(int on) { accept_host = on != 0; }

SIM_API void sim_set_timeout(double seconds) { timeout_s = seconds; }

// per allocation the unique bytes the last launch read and wrote; clears the bitmaps
SIM_API int sim_take_counts(uint32_t* ids, uint64_t* rd, uint64_t* wr, int cap, uint64_t* raw) {
    std::vector<std::pair<uint32_t, std::pair<uint64_t, uint64_t>>> per;
    for (uint32_t p : dirty) {
        uint64_t r = 0, w = 0;
        uint64_t* rb = (uint64_t*)(rbits + (size_t)p * (PAGE / 8));
        uint64_t* wb = (uint64_t*)(wbits + (size_t)p * (PAGE / 8));
        for (size_t i = 0; i < PAGE / 64; ++i) {
            r += __builtin_popcountll(rb[i]);
            w += __builtin_popcountll(wb[i]);
            rb[i] = wb[i] = 0;
        }
        page_dirty[p] = 0;
        const uint32_t id = owner[p];
        auto it = std::find_if(per.begin(), per.end(), [&](auto& e) { return e.first == id; });
        if (it == per.end()) per.push_back({id, {r, w}});
        else { it->second.first += r; it->second.second += w; }
    }
    dirty.clear();
    raw[0] = raw_read;
    raw[1] = raw_written;
    raw_read = raw_written = 0;
    int n = 0;
    for (auto& e : per) {
        if (n >= cap) break;
        ids[n] = e.first;
        rd[n] = e.second.first;
        wr[n] = e.second.second;
        ++n;
    }
    return n;
}

// run `tramp(args)` over the grid: 0, or a CUresult with sim_error() saying why
SIM_API int sim_launch(void (*tramp)(void**), void** args, uintptr_t params_lo, uintptr_t params_hi, unsigned gx,
                       unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                       const char* kernel) {
    const unsigned n = bx * by * bz;
    if (n == 0 || n > 1024) return ERR_INVALID_VALUE;
    launch_error = 0;
    error_text.clear();
    launch_deadline = now() + timeout_s;
    if (stack_slots < n) {
        if (stack_pool) munmap(stack_pool, stack_slots * (STACK + PAGE));
        stack_pool = (uint8_t*)reserve(n * (STACK + PAGE));
        if (!stack_pool) return ERR_OUT_OF_MEMORY;
        for (unsigned i = 0; i < n; ++i) mprotect(stack_pool + i * (STACK + PAGE), PAGE, PROT_NONE);
        stack_slots = n;
    }
    stacks = {(uintptr_t)stack_pool, (uintptr_t)stack_pool + stack_slots * (STACK + PAGE)};
    std::vector<uint8_t> smem(shared + 16);
    g_smem = (uint8_t*)(((uintptr_t)smem.data() + 15) & ~(uintptr_t)15);
    dyn_smem = {(uintptr_t)g_smem, (uintptr_t)g_smem + shared};
    params_range = {params_lo, params_hi};
    g_tramp = tramp;
    g_args = args;
    g_kernel = kernel;
    g_grid = {gx, gy, gz};
    g_block = {bx, by, bz};
    nthreads = (int)n;
    fibers.assign(n, Fiber{});
    warps.assign((n + 31) / 32, Warp{});
    run_queue.assign(n + 1, 0);
    unsigned ctl[2];
    asm volatile("stmxcsr %0; fnstcw %1" : "=m"(ctl[0]), "=m"(ctl[1]));
    for (unsigned z = 0; z < gz && !launch_error; ++z)
        for (unsigned y = 0; y < gy && !launch_error; ++y)
            for (unsigned x = 0; x < gx && !launch_error; ++x) {
                g_bidx = {x, y, z};
                if (shared) memset(g_smem, 0xff, shared);
                done_count = bar_count = 0;
                bar_line = -1;
                for (unsigned t = 0; t < n; ++t) {
                    Fiber& f = fibers[t];
                    f.tid = {t % bx, (t / bx) % by, t / (bx * by)};
                    f.state = RUN;
                    // the stack sim_ctx_switch pops: MXCSR / x87 word, r15 .. rbp, return address
                    uint64_t* sp = (uint64_t*)(stack_pool + t * (STACK + PAGE) + PAGE + STACK) - 8;
                    memcpy(&sp[0], ctl, 8);
                    for (int r = 1; r < 7; ++r) sp[r] = 0;
                    sp[7] = (uint64_t)(uintptr_t)&sim_fiber_start;
                    f.sp = sp;
                }
                for (Warp& w : warps) w = Warp{};
                rq_head = rq_tail = 0;
                for (unsigned t = 0; t < n; ++t) make_runnable((int)t);
                // back here when nothing is runnable: every thread exited, or the block is stuck
                cur = next_runnable();
                sim_ctx_switch(&sched_sp, fibers[cur].sp);
                if (done_count < (int)n && !launch_error) {
                    int at_bar = 0, at_warp = 0;
                    for (const Fiber& f : fibers) {
                        at_bar += f.state == AT_BARRIER;
                        at_warp += f.state == AT_WARP;
                    }
                    char buf[300];
                    snprintf(buf, sizeof buf,
                             "deadlock in kernel %s, block (%u,%u,%u): %d threads wait at __syncthreads (line %d), "
                             "%d at warp ops, %d exited: a barrier or warp op not reached by all threads",
                             kernel, x, y, z, at_bar, bar_line, at_warp, done_count);
                    fail(ERR_LAUNCH_FAILED, buf);
                }
            }
    cur = -1;
    g_smem = nullptr;
    dyn_smem = params_range = {0, 0};
    return launch_error;
}
