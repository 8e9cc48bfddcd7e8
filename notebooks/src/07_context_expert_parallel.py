# %% [markdown]
# # 07 · Context and expert parallelism: ring attention, Ulysses and mixture-of-experts on real ranks
#
# **What you will learn**
# - why long sequences need a fourth axis, **context parallelism** (CP): split the *sequence* over c ranks, keep
#   the weights whole, and make attention — the one operation that mixes tokens — work across the cut;
# - the **online-softmax merge** that lets attention be computed block by block, and **ring attention** built on
#   it: K/V blocks travel round the ring while each rank attends to the block it holds; no rank ever holds the
#   whole K and V, and activation memory per rank is ∝ S/c;
# - causal **load balance**: why contiguous chunks give the last rank c× the first one's work, and how the
#   **zig-zag** layout evens it; measured per rank under the modelled accelerator clock;
# - the two other designs: **all-gather CP** (Llama 3: gather K/V once per layer) and **Ulysses** (DeepSpeed:
#   all-to-all from sequence- to head-sharded), their bytes counted against the formulas, and which one suits which shape;
# - **mixture of experts** (MoE): a router, top-k, expert capacity and the drop rule, the load-balancing loss;
# - **expert parallelism** (EP): each rank holds E/e experts, tokens travel to them and back with **two
#   all-to-alls per MoE layer each way**; equal to one device (e = 2 and e = 4), bytes = formula, a hot expert
#   slowing its rank, and EP × DP on 4 ranks (which gradients are all-reduced over which group);
# - how the axes **compose** on one mesh: pipeline stages whose blocks are tensor-parallel (PP × TP on 4 ranks, and
#   DP × PP × TP on 8 in the tests), each rank's shard equal to one device's;
# - the course's planner (`course_lib/plan.py`, chapter 10) with **five axes**: its CP and EP bytes against this
#   chapter's measurements, and its ranking of layouts for an MoE model on a GPU node (a model, not a measurement).
#
# **What you need**: chapters 00 (collectives, the α–β model, the modelled accelerator clock), 02 (data
# parallelism) and 06 (tensor parallelism: attention heads, process groups). 2 CPU cores are enough: ranks are
# processes with the gloo backend; on GPUs the same cells use nccl.
#
# **Stored build:** 65 s on 2 cores (0% of them busy just before it started).
#
# Read along: `course_lib/context_parallel.py`, `course_lib/moe.py` and `course_lib/expert_parallel.py` (the
# algorithms, top to bottom); `course_lib/experiments/context_parallel.py` and
# `course_lib/experiments/expert_parallel.py` (what this notebook runs on ranks).

# %% tags=["nbval-ignore-output"]
import time

_t_notebook = time.perf_counter()
import os

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import display

from course_lib import context_parallel as cp
from course_lib import moe as M
from course_lib import show
from course_lib.expert_parallel import ExpertParallelMoE
from course_lib.experiments import context_parallel as CE
from course_lib.experiments import expert_parallel as EE
from course_lib.experiments.common import step_batch
from course_lib.launch import spawn
from course_lib.results import ADAMW, SGD, Result
from course_lib.viz import gantt

print(f"cores: {os.cpu_count()}")

# %% [markdown]
# ## 1. Five ways to split a training step
# <a id="context-parallelism"></a>
#
# | axis | what is split | each rank holds | what travels |
# |---|---|---|---|
# | data (DP, ZeRO, FSDP; ch. 02–04) | the batch | the model (or a shard of its state) | gradients, once per step |
# | tensor (TP; ch. 06) | every layer's matrices | 1/t of each layer | activations, 4 all-reduces per layer |
# | pipeline (PP; ch. 05) | the layers | L/p layers | boundary activations, point to point |
# | **context** (CP) | **the sequence** | the whole model, S/c tokens of each sequence | K and V (ring, all-gather) or all tokens (Ulysses), per layer |
# | **expert** (EP) | **the experts of MoE layers** | E/e experts | the tokens routed to other ranks' experts, per MoE layer |
#
# Everything in a transformer except attention works **per token**: embeddings, LayerNorms, MLPs and the loss run
# on a rank's S/c tokens with replicated weights — data parallelism over tokens, so the weights' gradients are
# summed over the CP group. Attention is the exception: every query needs every (earlier) key and value. So the
# statement "context parallelism splits the model's weights" is false: CP splits activations.
#
# Why bother: at long sequence lengths the activations, not the weights, fill the memory. Attention alone
# saves q, k, v, its output and one log-sum-exp per query for backward (a flash-style kernel never stores the S×S
# scores), and the MLP and LayerNorm inputs grow with S too. The formula for one attention layer, bf16, with 32 heads
# of 128 for q, k and v alike (Llama-3-8B's query shape; its grouped-query attention keeps only 8 K/V heads, so
# its k and v are a quarter of these) and a 128K-token sequence:

# %%
for c in (1, 8):
    saved = cp.ring_attention_saved_bytes(1, 32, 131072, 128, c, element_size=2)
    print(f"c = {c}: attention saves {saved / 2**30:5.2f} GiB per layer and rank (q, k, v, out, lse of "
          f"{131072 // c:,} tokens); × 32 layers = {32 * saved / 2**30:6.1f} GiB")

# %% [markdown]
# ## 2. Cutting the sequence: contiguous and zig-zag
#
# `shard_sequence` gives a rank its tokens, `unshard_sequence` puts the ranks' pieces back, and `positions` gives
# the **global** position ids of a rank's tokens — the position embedding and the causal mask must use these,
# never `arange(S/c)`. Contiguous: rank i holds chunk i of c. Zig-zag: the sequence is cut into 2c chunks and
# rank i holds chunks i and 2c−1−i, an early one and a late one (the reason is section 5).

# %%
S = 16
tokens = torch.arange(S)
for layout in cp.LAYOUTS:
    mine = [cp.shard_sequence(tokens, r, 4, layout, dim=0).tolist() for r in range(4)]
    print(f"{layout:>10}, c = 4: " + "  ".join(f"rank {r}: {m}" for r, m in enumerate(mine)))
    assert torch.equal(cp.unshard_sequence([torch.tensor(m) for m in mine], 4, layout, dim=0), tokens)
print("global positions of rank 1's tokens, zig-zag:", cp.positions(1, 4, S, "zigzag").tolist())
try:
    cp.shard_sequence(torch.zeros(1, 1, 12, 1), 0, 4, "zigzag")
except ValueError as err:
    print(f"ValueError: {err}")

# %% [markdown]
# ## 3. Attention block by block: the online-softmax merge
# <a id="online-softmax"></a>
#
# Softmax attention over keys $K = K_a \cup K_b$ can be computed from attention over each block alone, if each
# block also returns the log-sum-exp of its scores, $\ell_x = \log \sum_{j \in x} e^{s_j}$:
# $$\ell = \log(e^{\ell_a} + e^{\ell_b}), \qquad o = e^{\ell_a - \ell}\, o_a + e^{\ell_b - \ell}\, o_b .$$
# Block a's softmax is rescaled by its share of the total softmax mass. The rule is exact, associative and
# commutative, so blocks can arrive in any order: FlashAttention applies it to blocks of one GPU's memory, ring
# attention to blocks held by other ranks. (`torch.logaddexp` computes ℓ without overflow; raw `exp` of large
# scores would give inf/inf.)

# %%
for obj in (cp.block_attention, cp.merge):
    display(show.source(obj))

# %%
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
full = F.scaled_dot_product_attention(q, k, v)
o_a, l_a = cp.block_attention(q, k[..., :5, :], v[..., :5, :])  # keys 0–4
o_b, l_b = cp.block_attention(q, k[..., 5:, :], v[..., 5:, :])  # keys 5–7
merged, _ = cp.merge(o_a, l_a, o_b, l_b)
online = Result(title="attention over 8 keys from two blocks (5 + 3 keys), one process")
online.equal("merge(block a, block b)", merged, full, SGD, against="F.scaled_dot_product_attention")
online.equal("merge(block b, block a)", cp.merge(o_b, l_b, o_a, l_a)[0], full, SGD,
             against="F.scaled_dot_product_attention")
online.condition("the plain average (o_a + o_b) / 2", (merged - (o_a + o_b) / 2).abs().max().item(),
                 not torch.allclose((o_a + o_b) / 2, full, atol=1e-3), "differs: the blocks' masses differ")
print(online)

# %% [markdown]
# ## 4. Ring attention
# <a id="ring-attention"></a>
#
# Each rank keeps its queries. Its K/V block goes to the next rank (`isend` to r+1, `irecv` from r−1) **while** it
# attends to the block it holds; after c steps every query has seen every block, merged with the rule above. The
# next block is in flight during the current block's attention, so the transfer can run under compute (section 5
# measures whether it does). With a causal mask, blocks entirely in a query chunk's future are skipped, blocks in its
# past need no mask, and a diagonal block is computed in full and masked (positions compared globally, so zig-zag
# works).
#
# Backward (the same `autograd.Function`) saves only this rank's q, k, v, output and log-sum-exp — all ∝ S/c; the
# other ranks' K/V are **not** kept. It sends K/V round the ring once more, recomputes each block's
# probabilities from the saved log-sum-exp, keeps dQ, and passes each block's partial dK/dV round the ring behind
# it to the block's owner. The forward, as `course_lib` has it:

# %%
display(show.source(cp._RingAttention.forward))

# %% [markdown]
# A rank function a learner could put in a script: every rank draws the same full q, k, v, keeps its chunk, runs
# ring attention and backward, and compares its rows of the output and of dq, dk, dv with one device's
# `F.scaled_dot_product_attention` on the full sequence. The sum of every rank's `out.sum()` is the full
# `out.sum()`, so each rank's dk is its rows of the full gradient. It runs at c = 2 and c = 4, both layouts,
# causal and not; `CE.attention_equality` runs the same comparison for all three designs (ring, all-gather,
# Ulysses), gathered from every rank.

# %%
def ring_vs_one_device(seq_per_rank=8):
    import torch.distributed as dist

    from course_lib import context_parallel as cp
    from course_lib.launch import device

    c, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, 4, c * seq_per_rank, 8, generator=gen).to(device()) for _ in range(3)]
    cases = {}
    for layout in ("contiguous", "zigzag"):
        for causal in (True, False):
            mine = [cp.shard_sequence(t, r, c, layout).requires_grad_() for t in qkv]
            out = cp.ring_attention(*mine, causal=causal, layout=layout)
            out.sum().backward()
            full = [t.clone().requires_grad_() for t in qkv]
            ref = F.scaled_dot_product_attention(*full, is_causal=causal)
            ref.sum().backward()
            want = [cp.shard_sequence(t, r, c, layout) for t in (ref, *(f.grad for f in full))]
            got = [out, *(m.grad for m in mine)]
            cases[layout, causal] = [t.detach().cpu() for t in got], [t.detach().cpu() for t in want]
    return cases  # my rows of (out, dq, dk, dv): ring attention's and one device's


def equality_suite():
    return {"ring": ring_vs_one_device(), "all": CE.attention_equality()}


eq = {c: spawn(equality_suite, c) for c in (2, 4)}
ring_eq = Result(title="ring attention vs one device, every rank's rows")
for c, runs in eq.items():
    for layout, causal in runs[0]["ring"]:
        got = torch.cat([t.flatten() for run in runs for t in run["ring"][layout, causal][0]])  # every rank's
        want = torch.cat([t.flatten() for run in runs for t in run["ring"][layout, causal][1]])
        ring_eq.equal(f"c = {c}, {layout}, {'causal' if causal else 'full'}: out, dq, dk, dv", got, want, SGD,
                      against="F.scaled_dot_product_attention")

# %% tags=["nbval-ignore-output"]
print(ring_eq)
ring_eq.assert_passed()
print(eq[4][0]["all"])
for runs in eq.values():
    runs[0]["all"].assert_passed()

# %% [markdown]
# ## 5. The ring under the clock, and the causal imbalance
#
# As in chapters 02–05, each block's attention computes its real numbers and then **sleeps** its FLOPs
# (4·B·H·S_q·S_k·D) at the modelled accelerator's rate, while the K/V transfer runs on gloo's threads: a laptop
# then behaves like a GPU whose compute and network work at the same time. The step-time model predicts the
# ring's forward as c blocks of compute plus, per exchange, whatever the transfer takes beyond the block
# (α–β fitted on the spot). One spawn of 2 ranks runs this section, sections 6–7 and the CP GPT of section 8
# (`CE.notebook_suite`).

# %% tags=["nbval-ignore-output"]
cps = spawn(CE.notebook_suite, 2)
timeline = cps[0]["timeline"]
print(timeline.prediction)
print(f"K/V block {timeline.kv_bytes:,} B: α–β transfer {timeline.transfer_s * 1e3:.2f} ms vs one block's "
      f"compute {timeline.block_s * 1e3:.1f} ms")
print(f"the model expects each K/V transfer under its block: {timeline.transfer_s < timeline.block_s}")
print(timeline.timings.table())

# %% tags=["nbval-ignore-output"]
print(timeline)

# %% tags=["nbval-ignore-output"]
rows = CE.ring_gantt_rows(timeline)
hidden = all(row.verdict for row in timeline.checks() if "transfer done" in row.quantity)
ax = gantt(rows["timelines"], row_names=rows["row_names"], label_microbatches=True,
           title=f"ring attention forward, c = 2: each K/V transfer done before the next step "
                 f"needs it — {'on every rank' if hidden else 'not on every rank'}")
ax.set_xlabel("time since the barrier (ms); bar labels: ring step")
plt.tight_layout()
plt.show()

# %% [markdown]
# <a id="zigzag"></a>
# **Causal balance.** With contiguous chunks, rank r's queries see the keys of chunks 0…r: it computes r + 1
# blocks (the diagonal one in full, masked), so the last rank does **c×** the first rank's work — (2c−1)× if the
# masked half of the diagonal block were skipped too. Every rank waits for the slowest at the next collective, so
# the step is the last rank's. Zig-zag pairs chunk i with chunk 2c−1−i: every rank computes 2c+1 half-chunk
# blocks. `attention_work` counts the query–key scores per rank; the probe counts what each rank computed:

# %%
for c in (2, 4, 8):
    contiguous = [cp.attention_work(r, c, 1024 * c) for r in range(c)]
    zigzag = [cp.attention_work(r, c, 1024 * c, "zigzag") for r in range(c)]
    print(f"c = {c}: last / first rank's work, contiguous {contiguous[-1] / contiguous[0]:.1f}, "
          f"zig-zag {zigzag[-1] / zigzag[0]:.1f}; busiest rank contiguous / zig-zag "
          f"{max(contiguous) / max(zigzag):.2f} = c / ((2c+1)/4) = {c / ((2 * c + 1) / 4):.2f}")
balance = cps[0]["balance"]

# %% tags=["nbval-ignore-output"]
print(balance)

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6, 3))
width = 0.38
for i, layout in enumerate(cp.LAYOUTS):
    ms = [b * 1e3 for b in balance.busy[layout]]
    ax.bar([r + (i - 0.5) * width for r in range(len(ms))], ms, width, label=f"{layout}: measured compute")
    scale = balance.busy[layout][0] / balance.formula[layout][0] * 1e3
    ax.plot([r + (i - 0.5) * width for r in range(len(ms))], [w * scale for w in balance.formula[layout]], "k_",
            markersize=22, label="∝ work (formula)" if i else None)
cmp = balance.timings.compare("zigzag", "contiguous")
ax.set(xlabel="rank", ylabel="attention compute per forward (ms)", xticks=range(balance.cp_size),
       title=f"causal ring, S = {balance.seq_len}: the contiguous step takes {cmp.ratio:.2f}× the zig-zag one")
ax.legend(fontsize=8, frameon=False)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 6. All-gather CP and Ulysses
# <a id="allgather-cp"></a>
#
# **All-gather CP** (what Llama 3's training used): all-gather K and V once per layer, attend locally with the
# global causal mask, reduce-scatter dK/dV in backward. Forward sends the ring's bytes, in one collective that
# nothing overlaps; backward sends only dK/dV (the gathered K/V are still there), half the ring's. It holds the whole
# K and V (∝ S) during attention, and it is simple — any attention kernel works, including ones with masks a ring
# cannot split.
#
# <a id="ulysses"></a>
# **Ulysses** (DeepSpeed-Ulysses): an all-to-all turns q, k, v from sequence-sharded `[B, H, S/c, D]` into
# head-sharded `[B, H/c, S, D]`; each rank runs ordinary full-sequence attention on its H/c heads (heads are
# independent, as TP used in chapter 06), and an all-to-all turns the output back. H must be divisible by c, and
# c can never exceed the number of heads (with grouped-query attention, the number of K/V heads). Every rank
# attends over the whole sequence on its heads, so causal masking needs no load balancing.

# %%
for obj in (cp.allgather_attention, cp.ulysses_attention):
    display(show.source(obj))

# %% [markdown]
# <a id="cp-traffic"></a>
# **Traffic per rank and layer** (`*_traffic` in `course_lib/context_parallel.py`): the ring sends c−1 K/V blocks
# forward, and in backward c−1 K/V blocks plus c−1 dK/dV blocks: (c−1)/c of K and V, per direction, roughly
# constant in c. All-gather: the ring's bytes forward, only dK/dV backward. Ulysses: four all-to-alls each way (q, k,
# v, out), each sending
# (c−1)/c of a rank's B·H·(S/c)·D tensor: per-rank bytes **fall** as 1/c. Counted on the ranks of section 5's spawn
# (`CommLog` for ring and all-gather; Ulysses' `all_to_all_single` by its split sizes):

# %%
traffic = cps[0]["traffic"]
for key, phases in traffic.measured.items():
    print(f"{key:<17} forward {phases['forward']} B, backward {phases['backward']} B per rank; "
          f"formula {traffic.formula[key]['forward']:,} / {traffic.formula[key]['backward']:,} B")

# %% tags=["nbval-ignore-output"]
print(traffic)
traffic.assert_passed()

# %% [markdown]
# The formulas at a long-context shape (B = 1, 32 heads of 128, S = 128K, bf16), bytes per rank per layer in
# forward, as c grows:

# %%
print(f"{'c':>3} {'ring / all-gather (MiB)':>24} {'Ulysses (MiB)':>14}")
for c in (2, 4, 8, 16, 32):
    ring_mb = cp.ring_attention_traffic(1, 32, 131072, 128, c, element_size=2)["forward"] / 2**20
    uly_mb = cp.ulysses_attention_traffic(1, 32, 131072, 128, c, element_size=2)["forward"] / 2**20
    print(f"{c:>3} {ring_mb:>24,.0f} {uly_mb:>14,.0f}")
print("Ulysses at c = 64 with 32 heads:", end=" ")
try:
    cp.ulysses_attention_traffic(1, 32, 131072, 128, 64)
    print("the formula allows it — but the layer refuses it (H % c != 0)")
except ValueError as err:
    print(f"ValueError: {err}")

# %% [markdown]
# Which one, then: Ulysses sends fewer bytes per rank as c grows and uses any attention kernel, but stops at c = H
# (and needs fast all-to-all, usually inside a node); the ring has no such limit, overlaps its transfers with
# attention and holds only S/c of K/V, at the price of c sequential steps and the causal-balance care of section
# 5; all-gather CP is the simplest and holds the full K/V. Systems combine them (Ulysses inside a node, ring
# across nodes).

# %% [markdown]
# ## 7. Activation memory per rank ∝ S/c
# <a id="cp-memory"></a>
#
# The bytes saved for backward (the course's `SavedTensorMeter`, chapter 01) for the same full sequence, on one rank
# alone (c = 1) and on each of c = 2 ranks, against `ring_attention_saved_bytes`:

# %%
memory = cps[0]["memory"]
for name, saved in memory.saved.items():
    print(f"{name:<10} saved per rank: c = 1 {saved[1]:>7,} B, c = {memory.cp_size} {saved[memory.cp_size]:>7,} B")

# %% tags=["nbval-ignore-output"]
print(memory)
memory.assert_passed()

# %% [markdown]
# ## 8. The tiny GPT trained with context parallelism
# <a id="cp-training"></a>
#
# `context_parallel_gpt` swaps every block's attention for a CP one, embeds a rank's tokens at their **global**
# positions, and averages the loss over all the group's tokens; after backward, `allreduce_cp_grads` sums the
# replicated weights' partial gradients over the group (each rank's tokens contributed a part). Zig-zag ring
# attention, 3 AdamW steps, against one device on the full sequences:

# %%
display(show.source(cp.ContextParallelGPT.forward))
training = cps[0]["training"]

# %% tags=["nbval-ignore-output"]
print(f"losses (CP): {[round(x, 5) for x in training.losses]}")
print(training)
training.assert_passed()

# %% [markdown]
# ## 9. PyTorch's own context parallelism
# <a id="torch-context-parallel"></a>
#
# PyTorch has its own CP (`torch.distributed.tensor.experimental.context_parallel`): inside the context manager,
# the listed buffers are sharded along their sequence dimension over a `DeviceMesh` (load-balanced, zig-zag-like,
# for causal attention) and `F.scaled_dot_product_attention` is dispatched to a context-parallel implementation —
# by default it all-gathers K/V; `set_rotate_method("alltoall")` passes K/V shards round the ring instead. It is
# registered only for the CUDA attention kernels (flash, memory-efficient, cuDNN). The same rank function as a script
# would have it:

# %%
def torch_context_parallel(seq=16):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from course_lib import context_parallel as cp
    from course_lib.launch import device

    dev = device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, seq, 8, generator=gen).to(dev) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q, k, v: my shards now
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    r, c = dist.get_rank(), dist.get_world_size()
    mine = cp.shard_sequence(want, r, c, "zigzag")  # torch's load-balanced layout for causal attention
    return f"ran on {dev.type}: max |Δ| vs one device {(out - mine).abs().max().item():.1e}"


print(spawn(torch_context_parallel, 2)[0])

# %% [markdown]
# On a CPU that is a `NotImplementedError` (no sharding strategy for the CPU attention kernel), which is why the
# course's CP is its own. On GPUs the function compares its output with the zig-zag rows of one device's (not run
# here: no GPU in the stored build); torchtitan turns CP on with `--parallelism.context_parallel_degree`.

# %% [markdown]
# ## 10. Mixture of experts
# <a id="moe"></a>
#
# An MoE layer replaces a block's one MLP with E MLPs ("experts") and a **router** that sends each token to k of
# them: logits = x·Wᵀ, softmax over the E experts, top-k. The token's output is the gate-weighted sum of its k
# experts' outputs. Parameters grow E-fold; compute per token only k-fold (DeepSeek-V3: 256 routed experts, 8 per
# token). The router and the one-device layer:

# %%
display(show.source(M.route))
display(show.source(M.MoE.forward))

# %% [markdown]
# <a id="capacity"></a>
# **Capacity and drops.** Accelerators want fixed-size buffers, so expert i takes at most
# C = ⌈capacity_factor · N · k / E⌉ assignments. Which ones when more arrive: the first C in the **global token
# order** (the flattened batch; under EP, rank-major — all of rank 0's tokens, then rank 1's). A dropped assignment
# adds nothing: the residual stream carries the token past the layer. The rule needs only counts, which is what
# lets the EP layer below drop exactly the same tokens as one device.
#
# <a id="aux-loss"></a>
# **The load-balancing loss** (Switch Transformer): aux = E · Σᵢ fᵢ · Pᵢ, with fᵢ the fraction of assignments routed
# to expert i (counted, not differentiable) and Pᵢ its mean router probability. It is 1 when routing is uniform and
# grows as tokens crowd onto few experts; its gradient, through P, pushes probability away from the crowded ones.
# One layer, 64 tokens, 8 experts, top-2, capacity factor 0.75 (the chapter's setting, so that it drops):

# %%
cfg, mcfg = EE.moe_gpt_config(), EE.moe_config()
torch.manual_seed(0)
layer = M.MoE(cfg, mcfg)
torch.nn.init.normal_(layer.router.weight, std=0.5)
xs = torch.randn(64, cfg.d_model, generator=torch.Generator().manual_seed(1))
y, aux, stats = layer(xs)
f = stats.tokens_per_expert / (64 * mcfg.top_k)
P = M.route(xs, layer.router.weight, mcfg.top_k)[0].mean(0)
moe_table = Result(title=f"one MoE layer: N = 64, E = {mcfg.num_experts}, k = {mcfg.top_k}, "
                         f"capacity factor {mcfg.capacity_factor}")
moe_table.exact("capacity C", stats.capacity, M.expert_capacity(64, 8, 2, 0.75), "⌈0.75 · 64 · 2 / 8⌉ = 12")
moe_table.exact("assignments routed", int(stats.tokens_per_expert.sum()), 128, "N · k")
moe_table.exact("dropped", stats.dropped, int((stats.tokens_per_expert - stats.capacity).clamp(min=0).sum()),
                "Σ max(0, routed − C)")
moe_table.equal("aux loss (|Δ| vs the formula)", aux, mcfg.num_experts * (f * P).sum(), SGD, against="E · Σ f·P")
print("assignments per expert:", stats.tokens_per_expert.tolist(), "→ kept:", stats.kept_per_expert.tolist(),
      f"; aux loss {aux.item():.3f} (1 when uniform)")
print(moe_table)

# %% [markdown]
# ## 11. Expert parallelism: tokens travel to their experts
# <a id="expert-parallel"></a>
#
# Over e ranks, rank q holds experts q·E/e … (q+1)·E/e − 1; the ranks hold **different tokens** (a batch split, as
# in DP) and a replicated router. Per MoE layer:
# 1. **counts first**: every rank counts its assignments per expert and the group all-gathers the e × E matrix —
#    the global drop rule needs every earlier rank's counts, and from them every rank knows its send and receive
#    split sizes without another exchange;
# 2. **dispatch**: the kept assignments, sorted by expert (so grouped by destination rank), go out with one uneven
#    `all_to_all_single`;
# 3. each rank runs its experts on what arrived;
# 4. **combine**: a second `all_to_all_single`, splits swapped, brings every output home, where it is weighted by
#    its gate and added.
#
# Both all-to-alls are differentiable (backward = the reverse exchange), so backward has two more: **two
# all-to-alls per MoE layer forward and two backward**. An expert's weight gradient already sums every rank's
# tokens (they came to it); the replicated router's must be all-reduced, like a DP parameter. The layer:

# %%
display(show.source(ExpertParallelMoE.forward))

# %% [markdown]
# A training script for EP = 2 (the rank function below): every rank builds the same MoE GPT, keeps its experts
# (`expert_parallel_gpt`), trains on its half of each batch, and averages the gradients with
# `allreduce_expert_parallel_grads` (dense ones over all ranks; the experts' are already complete). The parent
# trains one device on the full batches and compares every parameter (each expert from the rank that holds it).

# %%
def ep_train(steps=3, global_batch=8):
    import torch.distributed as dist

    from course_lib.expert_parallel import allreduce_expert_parallel_grads, expert_parallel_gpt
    from course_lib.experiments import expert_parallel as EE
    from course_lib.experiments.common import step_batch
    from course_lib.launch import device
    from course_lib.moe import MoEGPT

    cfg, mcfg, dev = EE.moe_gpt_config(), EE.moe_config(), device()
    r, e = dist.get_rank(), dist.get_world_size()
    model = expert_parallel_gpt(MoEGPT(cfg, mcfg, seed=0).to(dev))  # my E/e experts, the rest replicated
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    losses = []
    for step in range(steps):
        x, y = step_batch(step, cfg, global_batch, dev)
        _, loss = model(x.chunk(e)[r], y.chunk(e)[r])  # my tokens
        opt.zero_grad()
        loss.backward()
        allreduce_expert_parallel_grads(model)
        opt.step()
        losses.append(loss.item())
    return {"state": {n: p.detach().cpu() for n, p in model.named_parameters()}, "losses": losses,
            "experts": model.blocks[0].mlp.expert_ids}


ep_runs = spawn(ep_train, 2)
ref = M.MoEGPT(cfg, mcfg, seed=0)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
ref_losses = []
for step in range(3):
    x, y_ = step_batch(step, cfg, 8)
    _, loss = ref(x, y_)
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
    ref_losses.append(loss.item())
merged = {n: t for run in ep_runs for n, t in run["state"].items()}
ep_table = Result(title="EP = 2 MoE GPT, 3 AdamW steps, vs one device")
ep_table.exact("expert ids per rank", [run["experts"] for run in ep_runs], [[0, 1, 2, 3], [4, 5, 6, 7]],
               "E/e contiguous")
names = [n for n, _ in ref.named_parameters()]
ep_table.condition("parameters held, both ranks together", f"{len(merged)} of {len(names)}", set(merged) == set(names),
                   "every one-device parameter, each expert once")
ep_losses = torch.tensor([run["losses"] for run in ep_runs]).mean(0)  # the model's loss: mean over ranks
ep_table.equal("loss per step (mean over ranks)", ep_losses, torch.tensor(ref_losses), ADAMW)
_ = ep_table.equal("parameters after 3 steps", merged, dict(ref.named_parameters()), ADAMW)

# %% tags=["nbval-ignore-output"]
print(ep_table)
ep_table.assert_passed()

# %% [markdown]
# The layer-level comparison — outputs, the loss with its auxiliary term, the input, router and expert gradients,
# and **the same dropped tokens** — runs in the chapter's EP spawn (`EE.notebook_suite`, 2 ranks), with the
# traffic, the imbalance and the hot expert below:

# %%
eps = spawn(EE.notebook_suite, 2)
print(f"dropped assignments, rank 0's layer: {eps[0]['equality'].dropped} (capacity {eps[0]['equality'].capacity})")

# %% tags=["nbval-ignore-output"]
for key in ("equality", "training"):
    print(eps[0][key])
    eps[0][key].assert_passed()

# %% [markdown]
# <a id="ep-4"></a>
# **e = 4.** The same layer comparison on 4 ranks, E/e = 2 experts each (`EE.ep_equality`, the chapter's 8 experts,
# top-2, capacity factor 0.75): every rank's tokens, drops and gradients against one device.

# %%
ep4 = spawn(EE.ep_equality, 4)
print("experts per rank, e = 4:", [run.expert_ids for run in ep4])

# %% tags=["nbval-ignore-output"]
print(ep4[0])
for run in ep4:  # every rank's table
    run.assert_passed()

# %% [markdown]
# The rule behind `E/e`: every rank holds whole experts, so e must divide E. The layer checks it when it is built
# (`check_divisible`, called by `ExpertParallelMoE.__init__`); at E = 8 and e = 3:

# %%
from course_lib.expert_parallel import check_divisible

try:
    check_divisible(mcfg.num_experts, 3)
except ValueError as err:
    print(f"ValueError: {err}")

# %% [markdown]
# ## 12. What the all-to-alls send
# <a id="ep-traffic"></a>
#
# Per rank and direction: the tokens kept for *other* ranks' experts × d_model × 4 bytes — the chunk for its own
# experts is a local copy (`all_to_all_bytes`, from the kept matrix). Dispatch and combine differ on a rank:
# dispatch sends this rank's tokens bound for other ranks' experts, combine sends back the outputs of the tokens
# other ranks sent to its experts. One training step of the EP GPT, read off the split sizes of every
# `all_to_all_single`:

# %% tags=["nbval-ignore-output"]
tr = eps[0]["traffic"]
print(tr)
tr.assert_passed()

# %% [markdown]
# A **capacity-padded** implementation (GShard, Switch) sends a fixed buffer instead, whatever the routing: E·C·d
# values per rank, with C applied **per group** — here per rank, on its own N/e tokens — and (e−1)/e of that buffer
# bound for other ranks. (Our layer applies one C to the whole batch, so that it drops the same tokens as one
# device.) Compared like for like, off-rank bytes against off-rank bytes:

# %%
lay0, e_ep = tr.layers[0], tr.world
n_rank, c_rank = lay0["tokens_per_rank"], lay0["capacity_per_rank"]
print(f"C per rank = ceil(cf·N_rank·k/E) = ceil({mcfg.capacity_factor}·{n_rank}·{mcfg.top_k}/{mcfg.num_experts}) = "
      f"{c_rank} (our layer's C over the whole batch: {lay0['capacity_group']}); padded buffer, off-rank part "
      f"(e−1)/e·E·C·d·4 = {lay0['padded_offrank']:,} B per direction")
for i, lay in enumerate(tr.layers):
    more = lay["padded_offrank"] > lay["forward"][0]
    print(f"layer {i}: dispatch {lay['forward'][0]:,} B of kept tokens to other ranks vs padded {lay['padded_offrank']:,} "
          f"B → the padded buffer sends {'more' if more else 'less'} ({lay['padded_offrank'] / lay['forward'][0]:.2f}×)")
even = (e_ep - 1) / e_ep * n_rank * mcfg.top_k * cfg.d_model * 4
print(f"evenly routed with nothing dropped, a rank sends (e−1)/e·N_rank·k·d·4 = {even:,.0f} B; the padded buffer is "
      f"{lay0['padded_offrank'] / even:.2f}× that (≈ the capacity factor {mcfg.capacity_factor}): padding sends "
      f"more than the routed load when cf > 1, and at cf < 1 it caps the buffer below it, dropping the rest")

# %% [markdown]
# ## 13. Imbalance: the auxiliary loss, and a hot expert
# <a id="hot-expert"></a>
#
# Nothing in the cross-entropy asks the router to spread its tokens: the first gradient steps can send more tokens
# to whichever experts they happen to favour, and only the auxiliary loss adds a pull toward an even load. Two short
# trainings of an MoE GPT (8 experts, top-1, routers drawn ~ N(0, 1)), without and with the auxiliary loss, from the
# same start; the load of the busiest expert over the mean load, at every step (1 = perfectly even), and each run's
# start, peak and last step printed under the plot:

# %% tags=["nbval-ignore-output"]
imb = eps[0]["imbalance"]
fig, ax = plt.subplots(figsize=(7, 3.2))
for name, run in imb.runs.items():
    ax.plot(run["max_over_mean"].amax(dim=-1).tolist(), label=f"{name} (coef {run['aux_loss_coef']})")
ax.axhline(1.0, color="k", lw=0.8, ls=":", label="perfect balance")
ax.set(xlabel="training step", ylabel="busiest / mean load\n(worst layer)")
ax.set_title(f"last {imb.tail} steps: busiest expert {imb.final['aux']:.2f}× the mean with the aux loss, "
             f"{imb.final['no aux']:.2f}× without", fontsize=10)
ax.legend(fontsize=8, frameon=False)
plt.tight_layout()
plt.show()
for name, run in imb.runs.items():
    worst = run["max_over_mean"].amax(dim=-1)
    peak = int(worst.argmax())
    print(f"{name:>6}: busiest / mean starts at {worst[0]:.2f}×, peaks at {worst[peak]:.2f}× (step {peak}), "
          f"last step {worst[-1]:.2f}×")

# %% tags=["nbval-ignore-output"]
total = int(imb.runs["aux"]["tokens_per_expert"][0, 0].sum())  # assignments per layer and step (N · k)
print(f"last {imb.tail} steps: busiest expert / mean — no aux {imb.final['no aux']:.2f}, aux {imb.final['aux']:.2f}; "
      f"dropped per layer and step, their mean (of {total} assignments) — no aux {imb.final_dropped['no aux']}, "
      f"aux {imb.final_dropped['aux']}")

# %% tags=["nbval-ignore-output"]
print(imb)
imb.assert_passed()

# %% [markdown]
# Under EP an unbalanced router is not only a quality problem: the rank holding the hot experts computes more, and
# the step (every rank meets at the combine all-to-all) waits for it. Below, the EP layer under the modelled clock,
# experts costed by the tokens routed to them: designed routing, balanced (every expert N·k/E tokens) against
# skewed (3/4 of the assignments to rank 0's experts). Predicted per rank: 3 · expert FLOPs / rate (forward and
# backward).

# %% tags=["nbval-ignore-output"]
hot = eps[0]["hot_expert"]
for variant, ranks in hot.per_rank.items():
    for r, d in enumerate(ranks):
        print(f"{variant:>8}, rank {r}: {d['routed']:>3} assignments, expert time {d['measured_s'] * 1e3:6.1f} ms "
              f"(predicted {d['predicted_s'] * 1e3:6.1f} ms)")
print(hot)
step = hot.timings.compare("balanced", "skewed")
print(f"the skewed step is slower than the balanced one, ranges separate: {step.sign < 0 and step.separated}")

# %% [markdown]
# ## 14. EP × DP on 4 ranks
# <a id="ep-dp"></a>
#
# On a (dp = 2, ep = 2) mesh, ranks {0, 1} and {2, 3} are EP groups (each holds all 8 experts between its two
# ranks, on different tokens), and ranks {0, 2} and {1, 3} hold the same experts. Gradients: dense parameters
# (embeddings, attention, LayerNorms, router, head) are replicated on every rank → all-reduced over **all 4**;
# an expert's gradient already sums its EP group's tokens → all-reduced over its **DP group** only. The counts
# all-gather runs on the EP group. Counted per group with `CommLog`:

# %%
mesh_runs = spawn(EE.ep_training, 4, kwargs=dict(ep_size=2))
print("collectives (op, tag, group):", mesh_runs[0].groups)

# %% tags=["nbval-ignore-output"]
print(mesh_runs[0])
for res in mesh_runs:  # every rank's table, not only rank 0's
    res.assert_passed()

# %% [markdown]
# ## 15. Three axes on one mesh: PP × TP (× DP)
# <a id="pp-tp"></a>
#
# The axes compose because each one talks only inside its own process groups. With pp = 2 stages and tp = 2 on
# 4 ranks, rank = stage · 2 + k: ranks {0, 1} hold stage 0's blocks, split by heads and MLP columns (chapter
# 06's f and g, all-reduced inside their TP group); ranks {2, 3} hold stage 1's. Ranks {0, 2} and {1, 3} form two
# pipelines that pass the whole boundary activation point to point (chapter 05's runner, given the pipeline's
# global ranks). The embedding, the final LayerNorm and the head stay whole: inside a TP group they see the same
# input and the same upstream gradient, so their gradients agree with no reduction. With dp > 1 each
# (stage, k) pair adds a data group that averages gradients after the pipeline step.
#
# The order of the axes in the rank number is a choice: pipeline outermost, tensor innermost is torchtitan's mesh
# order, because TP's four all-reduces per block are the most frequent messages and its ranks should be the
# closest ones (the GPUs of one NVLink island).

# %%
from course_lib.experiments import parallel_3d as P3

display(show.source(P3.mesh_3d))
display(show.source(P3.tensor_parallel_stage))

# %% [markdown]
# Each rank trains its shard for 3 AdamW steps; the check cuts and splits the one-device model, trained on the
# full batches, with the same two functions and compares shard with shard. The 8-rank DP 2 × PP 2 × TP 2 run is
# the same function with `dp=2`: `tests/test_parallel_3d.py` runs it on 8 ranks.

# %%
mesh3_runs = spawn(P3.dp_pp_tp_training, 4, kwargs=dict(pp=2, tp=2, steps=3))
for res in mesh3_runs:
    res.assert_passed()
print("rank → (stage, replica, TP index):", {r.rank: (r.stage, r.replica, r.k) for r in mesh3_runs})

# %% tags=["nbval-ignore-output"]
print(mesh3_runs[0])

# %% [markdown]
# ## 16. The planner with five axes
# <a id="planner"></a>
#
# Chapter 10's planner (`course_lib/plan.py`) adds up each GPU's memory and predicts a step
# (`course_lib/step_time.py`) for layouts of data, tensor and pipeline parallelism. This chapter's two axes join
# them: `Layout(cp=c)` — a rank holds S/c tokens of every sequence, so its activations are ÷ c, and ring attention
# sends its K/V block c−1 times per layer forward, K/V and dK/dV c−1 times each in backward; `Layout(ep=e)` for a
# `Model` with experts — expert parameters, their gradients and optimizer states ÷ e, and two all-to-alls per MoE
# layer each way. The rules it checks: the world is dp·tp·pp·cp, and e divides dp·cp (the EP groups are carved out
# of the ranks that hold different tokens). Its all-to-all formula assumes balanced routing with nothing dropped:
# (e−1)/e of a rank's N·k assignments go to other ranks, d values each. To measure that case, the rank function
# below (`experiments.expert_parallel.balanced_all_to_all`) designs the routing: token t's two experts are t mod E
# and t+1 mod E, so every expert takes the same share.

# %%
from course_lib.experiments.expert_parallel import balanced_all_to_all

display(show.source(balanced_all_to_all))

# %%
balanced = spawn(balanced_all_to_all, 2)
print("assignments kept per expert:", balanced[0]["kept"])

# %% [markdown]
# The planner's numbers at the configurations measured above, fp32 (`element_size=4`; the planner's default is
# 16-bit): `layout_step(...).bytes` for the K/V and all-to-all traffic of one step, `attention_saved_bytes` and
# `memory_per_gpu` for activations, `model_states_per_gpu` for the experts' parameters. The `Model`s describe one
# layer at the measured shapes; their Ψ (1e6) is a placeholder the bytes do not use.

# %%
from course_lib import plan
from course_lib.step_time import H100_NODE, layout_step

B, H, S, Dh = traffic.shape
c = traffic.cp_size
kv = layout_step(plan.Model(1e6, 1, H * Dh, H, S), plan.Layout(cp=c), H100_NODE, global_batch=B, micro_batch=B,
                 element_size=4).bytes
five = Result(title="the planner's bytes (plan, step_time) vs this chapter's measurements, fp32")
for key in ("ring contiguous", "ring zigzag"):
    for phase in ("forward", "backward"):
        five.exact(f"CP {c}, {key}: K/V bytes per rank in one step, {phase}", traffic.measured[key][phase],
                   [kv[f"CP K/V ({phase})"]] * c, "layout_step(…).bytes")
attn = plan.Model(1e6, 1, H * Dh, H, memory.shape[2])
for size in (1, memory.cp_size):
    five.exact(f"ring attention's saved bytes per rank, c = {size}", memory.saved["ring"][size],
               plan.attention_saved_bytes(attn, plan.Layout(cp=size), micro_batch=B, element_size=4),
               "plan.attention_saved_bytes")
acts = [plan.memory_per_gpu(attn, plan.Layout(cp=size))["activations"] for size in (1, memory.cp_size)]
five.exact(f"activations per rank, c = 1 / c = {memory.cp_size}",
           memory.saved["ring"][1] / memory.saved["ring"][memory.cp_size], acts[0] / acts[1],
           "memory_per_gpu: ÷ c")
states = plan.model_states_per_gpu(plan.Model.from_config(cfg, moe=mcfg), plan.Layout(dp=2, ep=2), precision="fp32")
held = [{n: t.numel() * t.element_size() for n, t in run["state"].items()} for run in ep_runs]  # section 11's ranks
five.exact("EP 2: expert parameter bytes per rank", [sum(v for n, v in h.items() if ".experts." in n) for h in held],
           [states["experts"]["params"]] * 2, "model_states_per_gpu: 4·Ψ_experts / e")
five.exact("EP 2: parameter bytes per rank, all", [sum(h.values()) for h in held], [states["params"]] * 2,
           "model_states_per_gpu: dense + experts / e")
moe_layer = plan.Model(1e6, 1, cfg.d_model, cfg.n_head, 64 // 2, experts=8, top_k=2, expert_hidden=2 * cfg.d_model)
a2a = layout_step(moe_layer, plan.Layout(dp=2, ep=2), H100_NODE, global_batch=2, element_size=4).bytes
for phase in ("forward", "backward"):
    five.exact(f"EP 2, balanced routing: all-to-all bytes per rank in one step, {phase}",
               [sum(run["calls"][phase]) for run in balanced], [a2a[f"EP all-to-all ({phase})"]] * 2,
               "layout_step(…).bytes: 2 × (e−1)/e·N·k·d·4")

# %% tags=["nbval-ignore-output"]
print(five)
five.assert_passed()

# %% [markdown]
# **Ranking layouts for an MoE model.** `plan.recommend` walks chapter 10's ladder (the least traffic that fits),
# then `plan.rank` orders every layout that fits — now with CP (for sequences of `plan.LONG_SEQUENCE` tokens or
# more) and EP (for a model with experts) — by the step the course's step-time model predicts on a named GPU node
# (published FLOP/s and link bandwidths, an assumed MFU). Below: an MoE GPT with the course's MLP experts (8 per
# layer, top-2) at a 16K-token sequence on two 8-GPU H100 nodes. The output is a model's prediction on published
# numbers; nothing in it was measured.

# %%
L_, h_, f_, V_ = 32, 4096, 14336, 32000
moe_gpt = plan.Model(L_ * 8 * 2 * h_ * f_ + L_ * (4 * h_ * h_ + 8 * h_) + 2 * V_ * h_, L_, h_, 32, 16384, V_,
                     "MoE GPT", experts=8, top_k=2, expert_hidden=f_)
moe_plan = plan.recommend(moe_gpt, plan.Cluster(80, 8, 2), profile=H100_NODE)
print(moe_plan.text(ranking=False))
print("\n".join(moe_plan.ranking_table().splitlines()[:11]))
print(f"… {len(moe_plan.ranking) - 10} more; with CP: {sum(lay.cp > 1 for lay, _, _ in moe_plan.ranking)}, "
      f"with EP: {sum(lay.ep > 1 for lay, _, _ in moe_plan.ranking)} of the {len(moe_plan.ranking)} that fit")

# %% [markdown]
# ## 17. Exercises
# `exercises/context_expert_parallel.py` — write
#
# ```python
# def merge(out_a, lse_a, out_b, lse_b) -> tuple[Tensor, Tensor]
#     # out_x (…, Sq, D): attention over key block x alone; lse_x (…, Sq): log-sum-exp of its scores
#     # → (out, lse) of attention over both blocks (section 3's online-softmax rule)
# def dispatch_splits(experts, num_experts, ep_size) -> list[int]
#     # experts (N, k): this rank's tokens' chosen experts; experts sharded contiguously over ep_size ranks
#     # → rows this rank's dispatch all_to_all_single sends to each rank (section 11's step 2, no capacity);
#     # ValueError naming both numbers when num_experts % ep_size != 0
# ```
#
# **What the checker compares.** `merge` on 2 ranks: random blocks cut at random points, your `(out, lse)` against
# attention over all keys at once and `torch.logsumexp` of all scores, within `SGD` (rtol 1e-5, atol 1e-6), and
# merge(a, b) against merge(b, a). `dispatch_splits` on 2 and 4 ranks: your splits against the library's on skewed
# routing (exact: they are counts), then sent through a real `all_to_all_single`, and the error for E % e ≠ 0.
# Until you write them the checks report UNSOLVED; the reference solutions pass (here on 2 ranks):

# %%
from course_lib.check import check

print(check("merge"))
print(check("dispatch_splits", world_sizes=(2,)))
print(check("merge", package="solutions"))
print(check("dispatch_splits", package="solutions", world_sizes=(2,)))

# %% [markdown]
# ## 18. O/X quiz

# %%
from course_lib.quiz import quiz

quiz("context-expert-parallel")

# %% [markdown]
# ## Summary
# - Context parallelism splits the sequence, not the weights: everything per token runs on S/c tokens with
#   replicated weights (their gradients summed over the group); attention needs the other ranks' K/V.
# - The online-softmax merge combines attention over blocks exactly; ring attention applies it to K/V blocks passed
#   round the ring (c − 1 exchanges forward, K/V and dK/dV again in backward) and saves only S/c per rank.
# - Causal attention with contiguous chunks gives the last rank c× the first's work; zig-zag evens it (counted and
#   timed above).
# - All-gather CP sends the ring's forward bytes in one collective (half its backward bytes) and holds the full
#   K/V; Ulysses' all-to-alls send bytes that fall as 1/c but need H divisible by c.
# - MoE: top-k routing, capacity C = ⌈factor · N · k / E⌉ with a global drop order, and the Switch auxiliary loss
#   that spreads the load (plotted above).
# - Expert parallelism: counts all-gathered, then two all-to-alls per MoE layer forward (dispatch, combine) and two
#   backward; bytes = tokens sent to other ranks × d; equal to one device, drops included; a hot expert's rank sets
#   the step; with DP, dense gradients are all-reduced over every rank and expert gradients over the DP group.
# - The axes compose because each talks only inside its own groups: on a (pp, dp, tp) mesh, TP's all-reduces stay in
#   a stage's TP group, activations travel along a pipeline of one rank per stage, gradients are averaged over a data
#   group; the shards equal one device's (checked above for PP 2 × TP 2).
# - The planner (`course_lib/plan.py`) has five axes: `Layout(cp=…, ep=…)` divides activations by c and experts
#   (with their gradients and optimizer states) by e, and `layout_step` counts the ring's K/V and the MoE
#   all-to-all bytes of a step; the table of section 16 compares them with this chapter's measurements. Its
#   ranking is a model on published numbers.

# %% tags=["nbval-ignore-output"]
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
