"""Train a small GPT a few steps in several engine configurations and save every configuration's
full fp32 state, to compare two versions of the code bitwise (a change that promises "the same
result" is checked against the commit before it, on the GPU where the CUDA paths run).

    git archive <before> lightning_zeroq benchmarks csrc | tar -x -C .before    # git-ignored folder
    (cd .before && torchrun --nproc-per-node 1 ../benchmarks/bitwise_versions.py /tmp/before.pt)
    torchrun --nproc-per-node 1 benchmarks/bitwise_versions.py /tmp/after.pt
    python benchmarks/bitwise_versions.py --compare /tmp/before.pt /tmp/after.pt

Configurations: stages 1, 2 and 3 without offload (stage 3 also unmanaged), stage 2 with INT8 gradients,
stage 2 and 3 with CPU optimizer offload, stage 3 with parameter offload too, stage 2 with half the
optimizer offloaded; the host step speculative (``offload_speculative_step``), asynchronous
(``offload_async_step``) and both, with full and with partial offload; bf16 autocast, fused AdamW, steps of one and of two backward passes, gradient
clipping in one step; any number of ranks (``--nproc-per-node``; rank 0 saves). Without CUDA it runs
on gloo and the CPU.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())  # the version under test: the working directory's packages


def renamed(name: str) -> str:
    """A parameter's name in ``lightning_zeroq``'s ``GPTModel`` from its name in the GPT that ``step_time.py``
    defined itself until 2026-12 (same shapes, order of initialization and arithmetic), so that states saved
    by either compare."""
    top = {"embed.weight": "tok_emb.weight", "norm.weight": "ln_f.weight"}
    block = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "qkv": "attn.qkv", "proj": "attn.proj", "gate_up": "mlp.fc",
             "down": "mlp.proj"}
    parts = name.split(".")
    if parts[0] == "blocks" and parts[2] in block:
        return ".".join([*parts[:2], block[parts[2]], *parts[3:]])
    return top.get(name, name)


if len(sys.argv) == 4 and sys.argv[1] == "--compare":
    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    for k in a:
        if k.endswith("_loss"):
            print(k, float(a[k]), float(b[k]))
            continue
        names = {n: n if n in b[k] else renamed(n) for n in a[k]}
        same = all(torch.equal(a[k][n], b[k][m]) for n, m in names.items())
        print(k, "bitwise equal" if same else "DIFFERENT", max(float((a[k][n] - b[k][m]).abs().max()) for n, m in names.items()))
    raise SystemExit(0)

from benchmarks.step_time import GPT  # noqa: E402
from lightning_zeroq import ZeroConfig, ZeroEngine  # noqa: E402

CONFIGS = {"s2_opt": dict(stage=2, offload_optimizer=True, reduce_bucket_size=3_000_000),
           "s3_opt": dict(stage=3, offload_optimizer=True, stage3_param_persistence_threshold=0),
           "s3_params": dict(stage=3, offload_optimizer=True, offload_parameters=True, stage3_param_persistence_threshold=0),
           "s3_none": dict(stage=3, stage3_param_persistence_threshold=0, stage3_prefetch_depth=2),
           "s2_ratio": dict(stage=2, offload_optimizer=True, offload_optimizer_ratio=0.5, reduce_bucket_size=3_000_000),
           "s1": dict(stage=1, reduce_bucket_size=3_000_000),
           "s2": dict(stage=2, reduce_bucket_size=3_000_000),
           "s2_qgrad": dict(stage=2, quantized_gradients=True, reduce_bucket_size=3_000_000),
           "s3_unmanaged": dict(stage=3, stage3_param_persistence_threshold=0, managed_gradient_accumulation=False),
           "s2_spec": dict(stage=2, offload_optimizer=True, offload_speculative_step=True, reduce_bucket_size=3_000_000),
           "s2_async": dict(stage=2, offload_optimizer=True, offload_async_step=True, reduce_bucket_size=3_000_000),
           "s3_params_spec_async": dict(stage=3, offload_optimizer=True, offload_parameters=True,
                                        stage3_param_persistence_threshold=0, offload_speculative_step=True,
                                        offload_async_step=True),
           "s2_ratio_spec_async": dict(stage=2, offload_optimizer=True, offload_optimizer_ratio=0.5,
                                       offload_speculative_step=True, offload_async_step=True,
                                       reduce_bucket_size=3_000_000)}
MICRO = 2  # backward passes per step: the accumulation window
gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
if gpu:
    torch.cuda.set_device(0)
out = {}
for name, kw in CONFIGS.items():
    torch.manual_seed(0)
    model = GPT(1000, 256, 4, 4, 704).to(dev)
    engine = ZeroEngine(model, ZeroConfig(**kw), param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    g = torch.Generator(device=dev).manual_seed(0)
    g.manual_seed(dist.get_rank())
    for step in range(4):
        for micro in range(MICRO if step % 2 else 1):  # steps of one backward and of several
            tokens = torch.randint(0, 1000, (2, 64), device=dev, generator=g)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(tokens)
            engine.backward(loss, boundary=micro == (MICRO if step % 2 else 1) - 1)
        if step == 2:
            engine.clip_grad_norm_(0.01)
        engine.step()
    out[name] = engine.full_state_dict()
    out[name + "_loss"] = loss.detach().cpu()
    engine.close()
if dist.get_rank() == 0:
    torch.save(out, sys.argv[1])
dist.destroy_process_group()
