"""Layers and kernels: the paged attention Hugging Face models call into, Bridge's fused Triton
kernels patched into a loaded model, the prompt-embeds overlay kernel, and the sampler."""
