"""Exact attention over a sequence split across processes: attnkit.distributed.ring_attention.

    torchrun --nproc-per-node 2 examples/ring_example.py

Each process holds 1/P of the sequence (the "zigzag" layout balances causal
work); keys and values travel around the ring of processes. Every rank checks
its shard of the output and of the gradients against single-process attention
(which it can afford here because the example is small).
"""

import torch
import torch.distributed as dist

import attnkit
from attnkit.distributed import ring_attention, shard, unshard


def main() -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # every rank builds the same whole tensors, then keeps its shard
    B, H, G, T, D = 2, 8, 2, 1024, 64  # T must be a multiple of 2P for "zigzag"
    q = torch.randn(B, H, T, D, device=device, requires_grad=True)
    k = torch.randn(B, G, T, D, device=device, requires_grad=True)
    v = torch.randn(B, G, T, D, device=device, requires_grad=True)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[1, 900:] = False  # padding at the end of the second sequence

    q_local, k_local, v_local = (shard(x.detach(), 2, layout="zigzag").requires_grad_() for x in (q, k, v))
    out_local = ring_attention(q_local, k_local, v_local, causal=True,
                               key_mask=shard(key_mask, 1, layout="zigzag"), layout="zigzag")  # (B, H, T/P, D)
    out_local.sum().backward()  # k/v gradients travel the ring back to the rank that holds them

    expected = attnkit.attention(q, k, v, causal=True, key_mask=key_mask)  # single process, for the check
    expected.sum().backward()  # the same loss: q.grad, k.grad, v.grad for the whole sequence
    torch.testing.assert_close(unshard(out_local.detach(), 2, layout="zigzag"), expected.detach(),
                               atol=1e-5, rtol=1e-5)
    for local, whole in ((q_local, q), (k_local, k), (v_local, v)):  # this rank's positions of each gradient
        torch.testing.assert_close(local.grad, shard(whole.grad, 2, layout="zigzag"), atol=1e-5, rtol=1e-5)
    print(f"rank {rank}/{dist.get_world_size()}: output {tuple(out_local.shape)} equals single-process attention, "
          f"and so do dq {tuple(q_local.grad.shape)}, dk {tuple(k_local.grad.shape)}, dv {tuple(v_local.grad.shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
