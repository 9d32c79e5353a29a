"""Version-pinned patches that let megatron-core run where it was not written to: `cpu` (megatron-core
0.19 assumes CUDA in a handful of places; nothing of it runs on a machine with a GPU),
`checkpoint` (its dist-checkpointing writer's results queue, while a save is planned) and
`process` (start: its import compiles nothing until a fused kernel is first called; end: a
worker process leaves without the interpreter's slow teardown). Import them from
their modules: this package imports nothing, so that `import policyworker` stays light."""
