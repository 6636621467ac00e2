"""The worker's side of the engine: one forward pass per scheduled step, on the device.

``model_runner`` owns the model, the KV cache and the step (``ModelRunner.execute``);
``inputs`` turns a ``SchedulerOutput`` into the batch tensors; ``sampler`` picks the tokens;
``cuda_graphs`` captures and replays decode steps; ``memory_profile`` sizes the KV cache from a
start-up profile; ``cpu_threads`` plans torch's threads on CPU. Nothing is imported here.
"""
