"""A checkpoint, or a Hugging Face directory, is the model (issue 28, item 9): `mini3d sample` of a
tied native checkpoint, of an imported GPT-2 and of an import whose vocabulary is wider than its
tokenizer's; `train --init-from-hf` and `--resume` of an imported Llama (rms_norm_eps=1e-6, a
300-token vocabulary) with no shape flag, checked against transformers; a shape flag that
contradicts the checkpoint is exit 2 naming it, before any process starts."""

from __future__ import annotations

import json

import pytest
import torch

from mini3d import cli
from mini3d.checkpoint.store import latest_dir, read_states
from mini3d.run.sample import generate, load_model

transformers = pytest.importorskip("transformers")
RUN = ["--steps", "1", "--seq-len", "16", "--global-batch", "2", "--no-progress", "--timeout", "150"]
LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, tie_word_embeddings=False)


def _llama(path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    model.save_pretrained(path)
    return model


def _gpt2(path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval()  # tied head, tanh GELU ("gelu_new")
    model.save_pretrained(path)
    return model


def _no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(cli, "launch_train", boom)


@pytest.mark.timeout(120)
def test_sample_a_tied_native_checkpoint(tmp_path, capsys):
    root = str(tmp_path / "ck")
    assert cli.main(["train", "--layers", "1", "--hidden", "32", "--tie-embeddings", "--save", root,
                     "--sample-every", "1", *RUN]) == 0  # sampling during training, tied, too
    capsys.readouterr()
    assert cli.main(["sample", root, "--prompt", "ab", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    model, meta = load_model(latest_dir(root))
    assert meta["model"]["tie_embeddings"] and model.head.out.weight is model.embed.wte.weight


@pytest.mark.timeout(60)
def test_sample_an_imported_gpt2_and_its_logits_equal_transformers(tmp_path, capsys):
    hf = _gpt2(tmp_path / "hf")
    assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    assert cli.main(["sample", str(tmp_path / "ck"), "--top-k", "1", "--max-new-tokens", "6"]) == 0
    model, _ = load_model(latest_dir(str(tmp_path / "ck")))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(x), hf(x).logits, atol=1e-5)


@pytest.mark.timeout(60)
def test_sample_a_wide_vocabulary_import_never_emits_an_undecodable_id(tmp_path, capsys):
    _llama(tmp_path / "hf")  # 300 ids, the byte tokenizer decodes 256
    assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    assert cli.main(["sample", str(tmp_path / "ck"), "--max-new-tokens", "60"]) == 0
    model, _ = load_model(latest_dir(str(tmp_path / "ck")))
    assert max(generate(model, [65], 60, seed=0)) >= 256  # unmasked, the wide table is drawn from
    assert max(generate(model, [65], 60, seed=0, n_vocab=256)) < 256


@pytest.mark.timeout(240)
def test_init_from_hf_and_resume_an_import_take_the_model_from_it(tmp_path):
    from mini3d.data.corpus import Batches, load_tokens
    from mini3d.checkpoint.hf import to_hf_state

    hf_dir, ckpt, saved = str(tmp_path / "hf"), str(tmp_path / "ck"), str(tmp_path / "out")
    hf = _llama(hf_dir)
    log1, log2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert cli.main(["train", "--init-from-hf", hf_dir, "--tp", "2", "--log-jsonl", str(log1), *RUN]) == 0
    assert cli.main(["import-hf", hf_dir, ckpt]) == 0
    assert cli.main(["train", "--resume", ckpt, "--log-jsonl", str(log2), "--save", saved, *RUN]) == 0
    x, y = Batches(load_tokens(), 16, 2, 0).global_batch_at(0)  # the batch of step 1 (seed 0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    for log in (log1, log2):  # the loss at step 1 is that of the HF weights, eps 1e-6 and all
        assert json.loads(open(log).readline())["loss"] == pytest.approx(want, abs=1e-5)
    # the resumed and trained checkpoint is still that model: transformers agrees on its weights
    model, meta = load_model(latest_dir(saved))
    assert (meta["model"]["norm_eps"], meta["model"]["vocab_size"]) == (1e-6, 300)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    ref.load_state_dict(to_hf_state(read_states(latest_dir(saved))["model"], model.cfg))
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x).logits, atol=1e-5)


@pytest.mark.timeout(60)
def test_a_conflicting_shape_flag_is_exit_2_naming_it(tmp_path, capsys, monkeypatch):
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ck")
    _llama(hf_dir)
    assert cli.main(["import-hf", hf_dir, ckpt]) == 0
    _no_launch(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", "--resume", ckpt, "--layers", "3", "--vocab", "256", *RUN]) == 2
    err = capsys.readouterr().err
    assert "--layers 3 (it has n_layers=2)" in err and "--vocab 256 (it has vocab_size=300)" in err
    assert f"checkpoint '{ckpt}/step-000000' is the model" in err
    assert "what may change is the run" in err and "Nothing was started" in err
    assert cli.main(["train", "--init-from-hf", hf_dir, "--family", "gpt2", "--model", "tiny",
                     *RUN]) == 2
    err = capsys.readouterr().err
    assert "--family gpt2 (it has family='llama')" in err and "n_layers=4 where it has 2" in err
    with pytest.raises(AssertionError, match="a process was started"):  # flags that agree pass
        cli.main(["train", "--resume", ckpt, "--layers", "2", "--family", "llama", "--vocab", "300",
                  *RUN])


@pytest.mark.timeout(120)
def test_a_resume_reads_with_the_checkpoints_tokenizer(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from mini3d.data.tokenizer import train_bpe

    bpe = train_bpe(["the quick brown fox jumps over the lazy dog. " * 50], 300,
                    str(tmp_path / "tokenizer.json"))
    root, model = str(tmp_path / "ck"), ["--layers", "1", "--hidden", "32"]
    assert cli.main(["train", *model, "--tokenizer", bpe.name, "--save", root, *RUN]) == 0
    seen = []
    monkeypatch.setattr(cli, "launch_train", lambda spec, *a, **k: seen.append(spec) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # no --tokenizer, no shape flag: all from the checkpoint
        cli.main(["train", "--resume", root, *RUN[2:], "--steps", "2"])
    assert seen[0].tokenizer == bpe.name and seen[0].model.vocab_size == bpe.vocab_size
