// Programmatic dependent launch (compute capability 9.0), shared by every kernel of ours.
//
// The host launches our kernels on a compute-capability-9.x GPU with the programmatic stream
// serialization attribute (`prism_quant::cuda_launch::Launch`): a kernel may then be launched before the
// kernel ahead of it on the stream has finished, so its launch and its blocks' start overlap that
// kernel's tail instead of following it. Every kernel therefore begins with PRISM_GRID_PROLOGUE(), its
// first statement (a test checks every `__global__` body in kernels/): `griddepcontrol.wait` holds the
// block until the kernels ahead of it have finished and their writes are visible, before it reads or
// writes any memory, so what a kernel computes is what it computes launched plainly; then
// `griddepcontrol.launch_dependents` lets the next kernel be launched once every block of this one
// has got this far. Elsewhere (other architectures, the compute_80 PTX that a later GPU would JIT) the
// prologue is empty and the host launches plainly.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PRISM_GRID_WAIT() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define PRISM_GRID_WAIT() \
    do {                  \
    } while (0)
#endif
// A kernel's first statement: the wait above.
#define PRISM_GRID_PROLOGUE() PRISM_GRID_WAIT()

// A kernel that reads, before waiting, only memory no kernel writes (weights, written once at load)
// begins with PRISM_GRID_WAIT_LATER() instead (the test accepts it), and its body calls
// PRISM_GRID_WAIT() — the prologue's two instructions — before it reads anything else or writes.
#define PRISM_GRID_WAIT_LATER() \
    do {                        \
    } while (0)
