"""A PyTorch model trained data-parallel through rtxmpi, checkpointed with rtxmpi's sharded files.

    python examples/torch_ddp.py                                   # one process
    mpiexec -n 2 python examples/torch_ddp.py --ckpt-dir ck        # 2 ranks, a checkpoint at the end
    mpiexec --oversubscribe -n 4 python examples/torch_ddp.py --ckpt-dir ck --resume --steps 40  # any world size

The model is a torch.nn MLP classifier; the data a fixed teacher's labels on random inputs (no
download), each step's global batch drawn from (seed, step) and split evenly over the ranks, so
every world size sees the same batches. Gradients live in one flat buffer (each parameter's
`.grad` a view of it); as backward finishes the parameters of a bucket, the bucket is averaged
over the ranks with an asynchronous rtxmpi all_reduce that runs while backward goes on
(GradAverager). Torch tensors go to the collectives as they are (DLPack, no copy; docs/interop.md).
The checkpoint holds the model's and Adam's state dicts, each tensor written by every rank as its
even 1/world piece (rtxmpi.checkpoint), and resumes at any world size. Needs torch.
"""
import argparse
import sys

import numpy as np

import rtxmpi
from rtxmpi.checkpoint import Shard, latest_step, load_checkpoint, save_checkpoint
from rtxmpi.errors import CheckpointError, ConfigError

try:
    import torch
except ImportError:
    torch = None

FEATURES, CLASSES, WIDTH = 32, 8, 64


class GradAverager:
    """The gradients of `model` in one flat buffer, averaged over `group` in buckets of at most
    `bucket_bytes`, each launched (all_reduce avg, async) as soon as backward has accumulated
    every gradient in it. Buckets follow the parameters in reverse (backward's order) and are
    launched in that order on every rank. Call `wait()` after backward, `zero_grad()` instead of
    the optimizer's (which would replace the views with new tensors)."""

    def __init__(self, model, group, bucket_bytes=1 << 16):
        params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.flat = group, torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        self.buckets, self.bucket_of, offset = [], {}, self.flat.numel()
        for p in reversed(params):  # flat in parameter order; buckets from the last one back
            offset -= p.numel()
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)  # no other reference kept:
            # autograd then accumulates into it in place
            if not self.buckets or (self.buckets[-1][1] - offset) * self.flat.element_size() > bucket_bytes:
                self.buckets.append([offset, offset + p.numel(), 0])  # start, stop, parameters
            bucket = self.buckets[-1]
            bucket[0] = offset
            bucket[2] += 1
            self.bucket_of[p] = len(self.buckets) - 1
            p.register_post_accumulate_grad_hook(self._ready)
        self.pending, self.next, self.works = [b[2] for b in self.buckets], 0, []

    def _ready(self, p):
        self.pending[self.bucket_of[p]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            start, stop, _ = self.buckets[self.next]
            self.works.append(self.group.all_reduce(self.flat[start:stop], op="avg", async_op=True))
            self.next += 1

    def wait(self):
        """Wait for every bucket of this backward (collective); then the grads are the averages."""
        if self.next != len(self.buckets):
            raise RuntimeError("backward did not reach every parameter; every rank must use all")
        for work in self.works:
            work.wait()
        self.pending, self.next, self.works = [b[2] for b in self.buckets], 0, []

    def zero_grad(self):
        self.flat.zero_()


def batch(step, global_batch, seed, rank, world_size):
    """This rank's rows of step `step`'s global batch: (x (B, FEATURES) float32, y (B,) int64)."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((global_batch, FEATURES)).astype(np.float32)
    teacher = np.random.default_rng(seed).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1)
    rows = slice(rank * global_batch // world_size, (rank + 1) * global_batch // world_size)
    return torch.from_numpy(x[rows]), torch.from_numpy(y[rows])


def state_tensors(model, optimizer):
    """Every tensor of the model's and the optimizer's state dicts, by a checkpoint name."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        out.update({f"optim.{index}.{k}": v for k, v in state.items()})
    return out


def save(group, ckpt_dir, step, model, optimizer):
    """Collective: each rank writes its even piece of every state tensor; metadata commits it."""
    shards = {name: Shard.even(t.detach().reshape(-1), group.rank, group.world_size)
              for name, t in state_tensors(model, optimizer).items()}
    shapes = {name: list(t.shape) for name, t in state_tensors(model, optimizer).items()}
    return save_checkpoint(group, ckpt_dir, step, shards, meta={"shapes": shapes}, overwrite=True)


def load(group, ckpt_dir, model, optimizer):
    """Collective: the latest checkpoint's state into model and optimizer (any world size saved);
    returns its step."""
    ckpt = load_checkpoint(group, ckpt_dir)
    shapes = ckpt.meta["shapes"]

    def tensor(name):
        return torch.from_numpy(ckpt.read(name)).reshape(shapes[name])

    model.load_state_dict({k: tensor(f"model.{k}") for k in model.state_dict()})
    state = optimizer.state_dict()
    state["state"] = {int(name.split(".")[1]): {} for name in shapes if name.startswith("optim.")}
    for name in shapes:
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state["state"][int(index)][key] = tensor(name)
    optimizer.load_state_dict(state)
    return ckpt.step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-bytes", type=int, default=1 << 14)
    p.add_argument("--ckpt-dir", default=None, help="save a sharded checkpoint at the end here")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir's latest")
    args = p.parse_args(argv)
    world = rtxmpi.init()
    if torch is None:
        print("error: this example needs torch (pip install torch)", file=sys.stderr)
        return 2
    if args.global_batch % world.world_size or args.steps < 1 or args.resume and not args.ckpt_dir:
        if world.rank == 0:
            print(f"error: --global-batch {args.global_batch} must divide by the {world.world_size} "
                  f"ranks, --steps must be >= 1, --resume needs --ckpt-dir", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(WIDTH, CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    grads = GradAverager(model, world, args.bucket_bytes)
    start = 0
    if args.resume and latest_step(args.ckpt_dir):
        start = load(world, args.ckpt_dir, model, optimizer)
        print(f"resumed from step {start}") if world.rank == 0 else None
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, args.global_batch, args.seed, world.rank, world.world_size)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        grads.zero_grad()
        loss.backward()  # buckets are averaged over the ranks while backward runs
        grads.wait()
        optimizer.step()
        mean = world.all_reduce(loss.detach().reshape(1), op="avg")  # the global batch's loss
        print(f"step {step} loss {mean.item():.6f}") if world.rank == 0 else None
    if args.ckpt_dir:
        path = save(world, args.ckpt_dir, args.steps, model, optimizer)
        print(f"saved {path}") if world.rank == 0 else None
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3 if isinstance(exc, CheckpointError) else 2)
