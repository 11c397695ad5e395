"""The engine: requests, their scheduling and KV-block bookkeeping, and the core that owns a step.

`core.EngineCore` drives everything; `prompts` turns user prompts into `request.Request`s;
`scheduler` plans each step (`step_io.SchedulerOutput`) over `block_manager` / `prefix_cache`.
Nothing here touches a tensor of the model: that is `runner.worker`'s job.
"""
