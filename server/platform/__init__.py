"""What the engine's process needs from the machine before a model loads: the device and
dtype, the CPU's flags, the thread count from the CPU quota (cpu_budget), glibc's malloc
tuned for a CPU engine (cpu_malloc), and the cache of start-up timing verdicts
(timing_cache). prepare.prepare_process is the one entry the engine calls.

Nothing here is imported at package import: the operator reads cpu_budget without torch."""
