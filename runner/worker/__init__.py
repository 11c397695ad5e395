"""The worker: loads the model, owns the device state (KV cache, staging buffers, CUDA graphs,
prompt-embeds overlay) and runs one planned step to sampled tokens (`model_runner.ModelRunner`).
`model_states` says per model family what the engine supports before anything loads."""
