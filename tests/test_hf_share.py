"""`train --init-from-hf`: each rank reads only its share of the Hugging Face directory (its
pipeline stage's tensors, its tp slices under pp2 x tp2, its experts under dp2 x ep2), seen
through safetensors itself
(tests/hf_workers.py patches `safe_open`, which safetensors' own `load_file` uses too, so reading
whole files again fails here), and the run still starts from transformers' loss. `HFState`'s
slices (transposed, concatenated, stacked and fused experts) equal the same rows of a whole read."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mini3d.checkpoint.hf import hf_config, read_hf_dir  # noqa: E402
from mini3d.checkpoint.hf_read import HFSource, HFState  # noqa: E402
from tests.hf_workers import watching_reads  # noqa: E402
from tests.test_hf import gpt2_config, moe_config, saved  # noqa: E402


def _stage(name: str) -> int:
    """The stage of an HF llama tensor under pp=2 of 4 layers (2 each; the norm and head last)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // 2
    return 0 if name.startswith("model.embed_tokens") else 1


@pytest.mark.timeout(300)
def test_a_pp2_tp2_rank_reads_only_its_stage_and_its_tp_half(tmp_path):
    from mini3d.config import Plan
    from mini3d.data.corpus import Batches, load_tokens
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec
    from tests.hf_workers import init_from_hf_and_watch_reads

    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = saved(hf_cfg, tmp_path / "hf").eval()
    state = hf.state_dict()
    assert "lm_head.weight" in state  # untied: the head is a tensor of its own, on stage 1
    spec = make_spec(hf_config(str(tmp_path / "hf")), Plan(tp=2, pp=2, micro_batches=2,
                     global_batch=4, seq_len=32), steps=1, init_from_hf=str(tmp_path / "hf"))
    results = launch(init_from_hf_and_watch_reads, 4, spec, device="cpu", timeout=250)
    total = sum(t.numel() * t.element_size() for t in state.values())
    for r in results:
        s, reads = r["coords"]["pp"], r["reads"]
        assert reads, r  # (None: init_from_hf read nothing through safetensors, or was not called)
        mine = {n for n in state if _stage(n) == s}
        assert {n for n, _ in reads} == mine, (r["coords"], sorted({n for n, _ in reads} ^ mine))
        # every 2-D llama tensor is split over tp (q/k/v/o, gate/up/down, embedding, head), each
        # rank reading its half; the norms are whole on both. Exact: nothing is read twice
        want = sum(t.numel() * t.element_size() // (2 if t.dim() == 2 else 1)
                   for n, t in state.items() if n in mine)
        assert sum(b for _, b in reads) == want < total / 3, (r["coords"], want, total)
    x, y = Batches(load_tokens(), 32, 4, 0).global_batch_at(0)  # the batch of step 1 (seed 0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    losses = [r["losses"] for r in results if r["losses"] is not None]
    assert len(losses) == 1 and losses[0][0] == pytest.approx(want, abs=1e-5), (losses, want)


def _rows(t, select):
    for k, idx in enumerate(select):
        if idx is not None:
            t = t.index_select(k, idx)
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["gpt2", "mixtral-per-expert", "qwen3-moe-fused"])
def test_a_share_is_the_same_rows_of_the_whole_read_and_reads_only_them(kind, tmp_path):
    """Experts 2..3 of every expert tensor (an ep rank), a tp-like row and column block of
    GPT-2's transposed Conv1D weights and of a fused qkv: equal to those rows of `read_hf_dir`,
    NaN elsewhere, and fewer bytes read than the tensor holds."""
    from safetensors.torch import save_file

    cfg_hf = {"gpt2": gpt2_config, "mixtral-per-expert": lambda: moe_config("mixtral"),
              "qwen3-moe-fused": lambda: moe_config("qwen3_moe")}[kind]()
    hf = saved(cfg_hf, tmp_path)
    if kind.endswith("fused"):  # transformers 5's own (fused) expert tensors on disk
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                  str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg, whole = read_hf_dir(str(tmp_path))
    two = torch.arange(2, 4)
    wanted = {n: [two] + [None] * (t.dim() - 1) for n, t in whole.items() if ".experts." in n}
    wanted["blocks.1.attn.qkv.weight"] = [torch.arange(4, 40), None]  # rows across q, k (and v)
    wanted["blocks.0.attn.proj.weight"] = [None, torch.arange(8, 24)]  # a column block
    assert any(".experts." in n for n in wanted) == (kind != "gpt2")
    reads = []
    undo = watching_reads(reads)
    try:
        with HFSource(str(tmp_path)) as source:
            lazy = HFState(source, cfg, wanted)
            for name, select in wanted.items():
                del reads[:]
                got = lazy[name]
                assert torch.equal(_rows(got, select),
                                   _rows(whole[name], select)), name
                assert torch.isnan(got).sum() == got.numel() - _rows(got, select).numel()
                read = sum(b for _, b in reads)
                assert 0 < read < whole[name].numel() * 4, (name, read)
    finally:
        undo()


@pytest.mark.timeout(300)
def test_a_dp2_ep2_rank_reads_only_its_experts(tmp_path):
    """Mixtral on disk one tensor per expert: an ep rank reads its 2 of the 4 experts of every
    layer and nothing of the others; the attention, norms, routers, embedding and head whole."""
    from mini3d.config import Plan
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec
    from tests.hf_workers import init_from_hf_and_watch_reads

    from safetensors.torch import load_file

    saved(moe_config("mixtral", vocab_size=256), tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))  # (the names on disk)
    on_disk = [n for n in state if ".experts." in n]
    assert len(on_disk) == 2 * 4 * 3  # 2 layers, 4 experts, w1 w2 w3
    spec = make_spec(hf_config(str(tmp_path / "hf")), Plan(dp=2, ep=2, global_batch=4, seq_len=16),
                     steps=1, init_from_hf=str(tmp_path / "hf"))
    results = launch(init_from_hf_and_watch_reads, 2, spec, device="cpu", timeout=250)
    assert sorted(r["coords"]["ep"] for r in results) == [0, 1]
    for r in results:
        reads, e = dict(r["reads"]), r["coords"]["ep"]
        assert len(reads) == len(r["reads"]), r  # nothing read twice
        mine = {n for n in state if ".experts." not in n
                or int(n.split(".experts.")[1].split(".")[0]) // 2 == e}
        assert set(reads) == mine, (e, sorted(set(reads) ^ mine))
        assert all(reads[n] == state[n].numel() * state[n].element_size() for n in reads), e
        assert len([n for n in reads if n in on_disk]) == len(on_disk) // 2
