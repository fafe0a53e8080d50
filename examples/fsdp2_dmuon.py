# examples/fsdp2_dmuon.py -- OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 fsdp2_dmuon.py
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon import DMuon


class Block(nn.Module):
    """A residual MLP block, the unit fully_shard wraps. The residual add is inside it:
    the block returns a new tensor, not a view (a Linear's output on 3-D input is one),
    so no in-place op on its output can skip FSDP2's pre-backward hook (FSDP2 warns on a
    view). Add residuals out of place (x = x + f(x)), as here."""

    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, n_blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh(device, (dist.get_world_size(),))

    torch.manual_seed(0)  # identical initial weights on every rank
    model = TinyLM().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensors sharded on dim 0

    # Matrices in the blocks -> Muon. Embedding, head, norms and biases -> AdamW.
    # (DMuon's default routing: pass model.named_parameters() without groups.)
    muon, adamw = [], []
    for name, p in model.named_parameters():
        is_hidden_matrix = p.ndim >= 2 and name.startswith("blocks.")
        (muon if is_hidden_matrix else adamw).append((name, p))
    optimizer = DMuon(
        [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}],
        lr=0.02, adamw_lr=3e-3, weight_decay=0.01,
    )

    # Each rank learns its own fixed batch of a repeating pattern.
    torch.manual_seed(1 + dist.get_rank())
    pattern = torch.randint(0, 256, (4, 16), device=device).repeat(1, 4)
    for step in range(1, 31):
        logits = model(pattern[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), pattern[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
