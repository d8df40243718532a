// The emulated GPU's CUDA built-ins: what the backend's CUDA C needs to compile as C++ and
// run on the CPU with a CUDA thread's semantics. Every thread of a block is a fiber on one
// OS thread; a fiber runs until it reaches `__syncthreads`, a warp
// shuffle or its end, then the next one runs. A barrier opens when every thread of the
// block still running has reached it; a shuffle when all 32 lanes of the warp have. A
// shuffle some lane never reaches, or a deadlock (threads waiting at different points),
// fails the launch naming the kernel, block and thread. The order the fibers run in
// between two barriers is forward, reversed or shuffled (`order`), so a kernel that reads
// what another thread writes without a barrier between gets another answer.
//
// The stand-in NVRTC puts this header before the program's source, and after it one entry
// point per kernel (`emu_entry_<name>`: the kernel called with the arguments cuLaunchKernel
// hands over, one pointer per argument), then compiles the whole with g++ into a shared
// object the stand-in driver loads as the module.
//
// A kernel that never waits (no barrier or shuffle in it or in what it calls, as the
// stand-in NVRTC reads its source: `waiting.rs`) runs without fibers: each thread to its
// end in turn, on the launching thread's own stack. Should it wait after all, the launch
// fails saying so.
#pragma once
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <tuple>
#include <utility>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
typedef dim3 uint3;

namespace emu {

enum class State { Runnable, AtBarrier, AtShuffle, Done };

// Switching between fibers. A fiber that stops (it waits, or has ended) switches straight
// to the next thread of the round that can run, the last one back to the scheduler: one
// switch per thread and turn, not two. On x86-64 a hand-written switch (the callee-saved
// registers pushed on the fiber's own stack, then the stack pointer swapped): swapcontext
// would also save the signal mask, a system call at every barrier and shuffle.
#if defined(__x86_64__)
extern "C" void emu_switch(void** save_sp, void* next_sp);
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
#define EMU_FAST_SWITCH 1
#endif

struct Thread {
#ifdef EMU_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    State state = State::Runnable;
    uint3 index;
    // A shuffle: this lane's value and lane mask going in, the value it gets coming out.
    uint64_t shuffle_in = 0, shuffle_out = 0;
    int shuffle_lane_mask = 0;
};

constexpr int WARP_SIZE = 32;
constexpr size_t STACK_BYTES = 256 * 1024;

// The launch under way on this OS thread.
struct Launch {
    const char* kernel = "";
    dim3 grid, block, block_index;
    Thread* threads = nullptr;
    unsigned count = 0;
    Thread* current = nullptr;
#ifdef EMU_FAST_SWITCH
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler;
#endif
    // This round's turns (indices into `threads`) and the next one to look at.
    unsigned* turn = nullptr;
    unsigned next = 0;
    void (*body)(void**) = nullptr;
    void** params = nullptr;
    char* error = nullptr;
    size_t error_len = 0;
    bool failed = false;
    // Threads run to their end without fibers (the kernel never waits); `escape` is where
    // a failure returns to then.
    bool direct = false;
    jmp_buf escape;
};
inline thread_local Launch* launch = nullptr;

// The round's next thread that can run (null once the round is over).
inline Thread* next_in_round(Launch& l) {
    while (l.next < l.count) {
        Thread* t = &l.threads[l.turn[l.next++]];
        if (t->state == State::Runnable) return t;
    }
    return nullptr;
}

// The current thread stops for now: the round's next thread runs, or the scheduler once
// the round is over or the launch has failed.
inline void pass_turn() {
    Launch& l = *launch;
    Thread* me = l.current;
    Thread* next = l.failed ? nullptr : next_in_round(l);
    l.current = next;
#ifdef EMU_FAST_SWITCH
    emu_switch(&me->sp, next ? next->sp : l.scheduler_sp);
#else
    swapcontext(&me->context, next ? &next->context : &l.scheduler);
#endif
}

// Runs the round's threads from `t` on, each until it stops; back when the round is over
// or the launch has failed.
inline void run_round_from(Thread& t) {
    launch->current = &t;
#ifdef EMU_FAST_SWITCH
    emu_switch(&launch->scheduler_sp, t.sp);
#else
    swapcontext(&launch->scheduler, &t.context);
#endif
    launch->current = nullptr;
}

// Records the first failure of the launch (with where it happened) and stops this thread.
inline void fail(const char* what) {
    Launch& l = *launch;
    if (!l.failed) {
        const uint3& t = l.current ? l.current->index : uint3{};
        snprintf(l.error, l.error_len, "kernel %s, block (%u, %u, %u), thread (%u, %u, %u): %s", l.kernel,
                 l.block_index.x, l.block_index.y, l.block_index.z, t.x, t.y, t.z, what);
        l.failed = true;
    }
    if (l.direct) longjmp(l.escape, 1);
    if (l.current) {
        l.current->state = State::Done;
        pass_turn();
    }
}

// What a thread that waits does in a kernel run without fibers.
inline void no_waiting_here() {
    if (launch->direct)
        fail("waits at a barrier or shuffle, but was run without fibers (the emulated NVRTC found no wait in it)");
}

inline void barrier() {
    no_waiting_here();
    launch->current->state = State::AtBarrier;
    pass_turn();
}

template <class T> T shuffle_xor(unsigned int mask, T value, int lane_mask) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 8 bytes");
    no_waiting_here();
    if (mask != 0xffffffffu) fail("a shuffle with a partial lane mask (the emulator checks full warps only)");
    Thread& me = *launch->current;
    me.shuffle_in = 0;
    memcpy(&me.shuffle_in, &value, sizeof(T));
    me.shuffle_lane_mask = lane_mask;
    me.state = State::AtShuffle;
    pass_turn();
    T out;
    memcpy(&out, &me.shuffle_out, sizeof(T));
    return out;
}

inline void thread_main() {
    launch->body(launch->params);
    launch->current->state = State::Done;
    pass_turn();  // never resumed
}

// A new fiber on `stack` (`bytes`, 16-aligned): its first switch-in "returns" into
// thread_main with the stack aligned as after a call.
inline void start_thread(Thread& t, char* stack, size_t bytes, Launch& l) {
#ifdef EMU_FAST_SWITCH
    (void)l;
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
    void** slot = reinterpret_cast<void**>(top - 16);  // the return address, 16-aligned
    slot[0] = reinterpret_cast<void*>(&thread_main);
    slot[1] = nullptr;
    void** registers = slot - 6;  // r15, r14, r13, r12, rbx, rbp
    for (int i = 0; i < 6; i++) registers[i] = nullptr;
    t.sp = registers;
#else
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = stack;
    t.context.uc_stack.ss_size = bytes;
    t.context.uc_link = &l.scheduler;
    makecontext(&t.context, thread_main, 0);
#endif
}

// The order fibers run in between two synchronisations.
enum Order { Forward = 0, Reverse = 1, Shuffled = 2 };

// The order of the threads' next turns: the last one's reversed, or shuffled.
inline void next_turns(unsigned* turn, unsigned n, int order, uint64_t* seed) {
    if (order == Reverse) std::reverse(turn, turn + n);
    if (order == Shuffled) {
        for (unsigned i = n; i > 1; i--) {
            *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
            std::swap(turn[i - 1], turn[(*seed >> 33) % i]);
        }
    }
}

// Runs one block of a kernel that never waits: each thread to its end, in the order of a
// fiber block's first turns; false once the launch has failed.
inline bool run_block_directly(int order, uint64_t* seed) {
    Launch& l = *launch;
    unsigned n = l.count;
    unsigned* turn = static_cast<unsigned*>(alloca(n * sizeof(unsigned)));
    for (unsigned i = 0; i < n; i++) turn[i] = i;
    next_turns(turn, n, order, seed);
    if (setjmp(l.escape)) return false;  // (a failure: `fail` came back here)
    for (unsigned k = 0; k < n; k++) {
        l.current = &l.threads[turn[k]];
        l.body(l.params);
        l.current->state = State::Done;
    }
    l.current = nullptr;
    return true;
}

// Runs one block to its end; false once the launch has failed.
inline bool run_block(int order, uint64_t* seed) {
    Launch& l = *launch;
    unsigned n = l.count;
    unsigned* turn = static_cast<unsigned*>(alloca(n * sizeof(unsigned)));
    for (unsigned i = 0; i < n; i++) turn[i] = i;
    for (;;) {
        next_turns(turn, n, order, seed);
        l.turn = turn;
        l.next = 0;
        Thread* first = next_in_round(l);
        bool ran = first != nullptr;
        if (first) run_round_from(*first);
        if (l.failed) return false;
        // Release warps whose every lane waits at a shuffle.
        bool released = false;
        for (unsigned w = 0; w * WARP_SIZE < n; w++) {
            Thread* lanes = l.threads + w * WARP_SIZE;
            unsigned width = std::min<unsigned>(WARP_SIZE, n - w * WARP_SIZE);
            unsigned waiting = 0, done = 0;
            for (unsigned i = 0; i < width; i++) {
                waiting += lanes[i].state == State::AtShuffle;
                done += lanes[i].state == State::Done;
            }
            if (waiting == 0) continue;
            if (waiting + done == width && done > 0) {
                l.current = &lanes[0];
                for (unsigned i = 0; i < width; i++)
                    if (lanes[i].state == State::AtShuffle) l.current = &lanes[i];
                fail("a warp shuffle that not every lane of the warp reaches (some lanes have exited)");
                return false;
            }
            if (waiting != width || width != WARP_SIZE) continue;
            for (unsigned i = 0; i < width; i++) {
                unsigned from = i ^ static_cast<unsigned>(lanes[i].shuffle_lane_mask);
                lanes[i].shuffle_out = from < width ? lanes[from].shuffle_in : lanes[i].shuffle_in;
            }
            for (unsigned i = 0; i < width; i++) lanes[i].state = State::Runnable;
            released = true;
        }
        if (released) continue;
        unsigned at_barrier = 0, done = 0;
        for (unsigned i = 0; i < n; i++) {
            at_barrier += l.threads[i].state == State::AtBarrier;
            done += l.threads[i].state == State::Done;
        }
        if (done == n) return true;
        if (at_barrier > 0 && at_barrier + done == n) {
            // Threads that have exited count as arrived, as on the hardware.
            for (unsigned i = 0; i < n; i++)
                if (l.threads[i].state == State::AtBarrier) l.threads[i].state = State::Runnable;
            continue;
        }
        if (!ran) {
            for (unsigned i = 0; i < n; i++)
                if (l.threads[i].state == State::AtShuffle) l.current = &l.threads[i];
            fail("deadlock: some threads wait at __syncthreads while others wait at a warp shuffle");
            return false;
        }
    }
}

constexpr size_t PAGE = 4096, STACK_SPAN = STACK_BYTES + PAGE;

// The fibers' stacks of the launches on this host thread, each with a page that faults
// below it (a stack overflow stops there): made for the largest block so far and kept, as
// mapping them anew for every launch cost more than the kernels.
struct Stacks {
    char* base = nullptr;
    unsigned count = 0;
    ~Stacks() {
        if (base) munmap(base, STACK_SPAN * count);
    }
};
inline thread_local Stacks stacks_here;

// Stacks for `count` fibers; null when there is no memory for them.
inline char* stacks_for(unsigned count) {
    if (stacks_here.count >= count) return stacks_here.base;
    if (stacks_here.base) munmap(stacks_here.base, STACK_SPAN * stacks_here.count);
    stacks_here = Stacks{};
    void* p = mmap(nullptr, STACK_SPAN * count, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    char* base = static_cast<char*>(p);
    for (unsigned i = 0; i < count; i++) mprotect(base + i * STACK_SPAN, PAGE, PROT_NONE);
    stacks_here.base = base;
    stacks_here.count = count;
    return base;
}

// Runs `body` (a kernel's entry) on every thread of every block of `grid` x `block`, block
// after block, each thread a fiber where the kernel `waits`; 0 on success, else the
// failure in `error`.
inline int run(const char* kernel, void (*body)(void**), void** params, dim3 grid, dim3 block, int order,
               uint64_t seed, bool waits, char* error, size_t error_len) {
    Launch l;
    l.kernel = kernel;
    l.grid = grid;
    l.block = block;
    l.body = body;
    l.params = params;
    l.error = error;
    l.error_len = error_len;
    l.count = block.x * block.y * block.z;
    if (l.count == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
        snprintf(error, error_len, "kernel %s: an empty grid or block", kernel);
        return 1;
    }
    if (l.count > 1024) {
        snprintf(error, error_len, "kernel %s: %u threads per block, more than 1024", kernel, l.count);
        return 1;
    }
    if (launch) {  // (kernels launch no kernels here: the fibers' stacks are the thread's)
        snprintf(error, error_len, "kernel %s: launched from inside another kernel", kernel);
        return 1;
    }
    l.direct = !waits;
    char* stacks = waits ? stacks_for(l.count) : nullptr;
    if (waits && !stacks) {
        snprintf(error, error_len, "kernel %s: no memory for %u thread stacks", kernel, l.count);
        return 1;
    }
    Thread* threads = new Thread[l.count];
    l.threads = threads;
    Launch* outer = launch;
    launch = &l;
    bool ok = true;
    for (unsigned bz = 0; ok && bz < grid.z; bz++)
        for (unsigned by = 0; ok && by < grid.y; by++)
            for (unsigned bx = 0; ok && bx < grid.x; bx++) {
                l.block_index = dim3{bx, by, bz};
                uint3 index{0, 0, 0};
                for (unsigned i = 0; i < l.count; i++) {
                    Thread& t = threads[i];
                    t.state = State::Runnable;
                    t.index = index;
                    if (++index.x == block.x) {  // (x fastest, then y, then z)
                        index.x = 0;
                        if (++index.y == block.y) index.y = 0, index.z++;
                    }
                    if (waits) start_thread(t, stacks + i * STACK_SPAN + PAGE, STACK_BYTES, l);
                }
                ok = waits ? run_block(order, &seed) : run_block_directly(order, &seed);
            }
    launch = outer;
    delete[] threads;
    return ok ? 0 : 1;
}

// Calls `kernel` with the arguments `params` points at, one pointer per argument, as
// cuLaunchKernel hands them over.
template <class... A, size_t... I> void call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}
template <class... A> void call(void (*kernel)(A...), void** params) {
    call(kernel, params, std::index_sequence_for<A...>{});
}

// Where the launch under way is: what an out-of-bounds access report names.
inline int where(char* out, size_t len) {
    if (!launch) return 0;
    const uint3 t = launch->current ? launch->current->index : uint3{};
    return snprintf(out, len, "kernel %s, block (%u, %u, %u), thread (%u, %u, %u)", launch->kernel,
                    launch->block_index.x, launch->block_index.y, launch->block_index.z, t.x, t.y, t.z);
}

}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
#define threadIdx (emu::launch->current->index)
#define blockIdx (emu::launch->block_index)
#define blockDim (emu::launch->block)
#define gridDim (emu::launch->grid)

inline void __syncthreads() { emu::barrier(); }
template <class T> inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask) {
    return emu::shuffle_xor(mask, value, lane_mask);
}
inline float __int_as_float(int x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}
inline float __uint_as_float(unsigned int x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}
inline unsigned int __float_as_uint(float x) {
    unsigned int u;
    memcpy(&u, &x, 4);
    return u;
}
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
