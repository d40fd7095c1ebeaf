"""Models leaving the training run (nanofp8/checkpoint.py, export.py, sample.py, train.py init_from).

What is checked, on tiny models:
  * every level samples: bf16, O1, O2 in one process, O3 on 2 ranks and TP=2 (torchrun, gloo),
    each through sample.py with fp8_weights=True too;
  * the weights read back are the trained ones: O3's from the sharded fp16 masters (not the FP8
    copies), TP's shards merged. Shown by evaluating the converted model on the evaluation batches
    of the run that wrote it: the same validation loss;
  * a checkpoint resumes at another level or layout (O2 -> bf16, O2 -> O1, O3 at 2 ranks -> 1
    process, TP=2 -> 1 process), and the log says what restarts;
  * the portable export: float8_e4m3fn weights + fp32 scales + JSON, readable with safetensors
    alone, identical logits after export -> import; bad files fail with a message naming the
    tensor;
  * Hugging Face GPT-2 in and out against transformers itself (a tiny random model made here, no
    download): logits agree to 1e-4 in fp32 both ways; init_from=<dir> fine-tunes it;
  * Hugging Face LLaMA in and out against transformers' LlamaForCausalLM: logits within 1e-5
    relative in fp32 both ways, nanofp8 -> HF -> nanofp8 bit for bit, init_from=<dir> fine-tunes
    it, and a config our model does not compute is refused in one line naming the key; grouped-query
    attention both ways (num_key_value_heads), a Llama-3-shaped model (128,256 tokens) included;
  * FP8 LLaMA exports that transformers loads as FP8: compressed-tensors' float-quantized (row
    scales) and transformers' fp8 (128x128 tiles), holding the bytes the FP8 GEMMs read in
    training; their logits match nanofp8's own FP8 models within bounds derived in the tests;
  * frozen FP8 models: 1 byte per weight plus one fp32 scale per row, and the logits stay close.
"""

import copy
import json
import os
import struct

import pytest
import torch

import conftest
import export
import sample
import train
from nanofp8.checkpoint import (find_checkpoint, fp32_moments, freeze_fp8, load_for_inference, load_moments,
                                read_checkpoint, with_shards)
from nanofp8.fp8 import E4M3, quantize, sqnr
from nanofp8.interop import (export_hf_gpt2, export_hf_llama, export_portable, load_hf_gpt2, load_hf_llama,
                             read_hf_weights,
                             load_portable)
from nanofp8.configurator import ConfigError
from nanofp8.model import GPT, GPTConfig, apply_fp8
from nanofp8.ckptfile import CheckpointError, load_checkpoint, load_model_state, save_checkpoint
from nanofp8.optim import dequantize_blocks

from conftest import newest_checkpoint
from nanofp8.run import MODEL_KEYS

pytestmark = pytest.mark.usefixtures("shakespeare")

# conftest's tiny model, 2 micro-batches per step, 3 steps
TINY = conftest.TINY + ["gradient_accumulation_steps=2", "lr_decay_iters=8", "eval_interval=3", "max_iters=3"]
ARGS = dict(vocab_size=84, n_layer=2, n_head=2, n_embd=32, block_size=32)


def torchrun(nproc, *args):
    return conftest.torchrun(nproc, *TINY, *args, timeout=240).stdout


def val_losses(stdout):
    return [float(line.split("val loss ")[1]) for line in stdout.splitlines() if line.startswith("step ")]


def sample_runs(out_dir, capsys):
    """sample.py on out_dir with FP8 weights (which measures the full-precision model first)."""
    sample.main([f"--out_dir={out_dir}", "--max_new_tokens=8", "--num_samples=1", "--start=ROMEO",
                 "--fp8_weights=True", "--fp8_eval_iters=2"])
    out = capsys.readouterr().out
    assert out.count("ROMEO") == 1 and "E4M3 + scales" in out and "with FP8 weights" in out, out
    return out


# ---------------------------------------------------------------- every level samples and converts


def test_o2_samples_and_resumes_at_o1_and_bf16(tmp_path, capsys):
    """O2 -> sample (fp16 master / scale resolved), O2 -> O1 (the same evaluation loss: the
    weights carried over exactly), O2 -> bf16 (trains on, the log names what restarts)."""
    out = str(tmp_path / "o2")
    hist = train.main(TINY + ["precision=O2", f"out_dir={out}"])
    capsys.readouterr()
    sample_runs(out, capsys)
    state, info = read_checkpoint(out)
    ckpt = load_checkpoint(newest_checkpoint(out))
    k = "blocks.0.mlp.c_fc.weight"
    assert ckpt["model"][k].dtype == torch.float16 and state[k].dtype == torch.float32
    assert torch.equal(state[k], ckpt["model"][k].float() / ckpt["model"][k + "_scale"])
    # O1 casts the fp32 weight to E4M3 exactly as O2 casts its fp16 master (the same values):
    # evaluated on the same batches, the loss of the converted model is the O2 run's.
    o1 = train.main(TINY + ["precision=O1", f"out_dir={out}", "init_from=resume", "eval_only=True"])
    printed = capsys.readouterr().out
    assert "converting the checkpoint of iter 3 (precision=O2) to precision=O1" in printed
    assert "carried over: weights exactly (fp32 = fp16 master / scale), Adam moments" in printed
    assert "RE-INITIALIZED: FP8 scaling state" in printed
    assert abs(o1["evals"][0][2] - hist["evals"][-1][2]) < 1e-6, (o1["evals"], hist["evals"])
    bf16 = train.main(TINY + ["precision=bf16", f"out_dir={out}", "init_from=resume", "max_iters=5"])
    assert "to precision=bf16" in capsys.readouterr().out
    assert [it for it, _ in bf16["losses"]] == [3, 4]
    after = load_checkpoint(newest_checkpoint(out))
    assert after["config"]["precision"] == "bf16"
    assert after["optimizer"]["state"][0]["step"] == 5  # Adam's step count went on: 3 at O2, 2 at bf16


@pytest.mark.parametrize("precision", ["bf16", "O1"])
def test_bf16_and_o1_sample(tmp_path, capsys, precision):
    out = str(tmp_path / precision)
    train.main(TINY + [f"precision={precision}", f"out_dir={out}"])
    capsys.readouterr()
    sample_runs(out, capsys)
    model, info = load_for_inference(out)
    ref = load_checkpoint(newest_checkpoint(out))["model"]
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.dist
def test_o3_two_ranks_to_one_process(tmp_path, capsys):
    """O3 on 2 ranks: the weights come back from the sharded fp16 masters, not from the FP8 copies
    in the model state, and in the right order: cast to E4M3 they give back (all but a few
    rounding ties of) the FP8 bytes the ranks gathered. Each rank's shard is a file of its own.
    sample.py and export.py read them; so does a file of an older nanofp8 that holds every shard
    itself; O3 on 1 rank resumes them (shards re-cut, moments too), and so does O2 in a plain
    process."""
    out = str(tmp_path / "o3")
    torchrun(2, "precision=O3", f"out_dir={out}")
    assert sorted(os.listdir(os.path.dirname(newest_checkpoint(out)))) == [
        "ckpt.pt", "manifest.json", "optimizer-rank0.pt", "optimizer-rank1.pt"]
    state, info = read_checkpoint(out)
    assert info["layout"]["zero_world"] == 2
    fp8 = load_checkpoint(newest_checkpoint(out))["model"]
    for k in ("blocks.0.attn.c_attn.weight", "blocks.1.mlp.c_proj.weight"):
        assert fp8[k].dtype == torch.float8_e4m3fn
        copy = fp8[k].float() / fp8[k + "_scale"]
        assert 25 < sqnr(state[k], copy) < 40  # the E4M3 rounding of the master: not the same tensor
        recast = quantize(state[k], E4M3).data.view(torch.uint8)  # fp16 master -> E4M3 again
        assert (recast == fp8[k].view(torch.uint8)).float().mean() > 0.99
    sample_runs(out, capsys)
    export.main([f"--out_dir={out}", f"--to={tmp_path / 'fp32'}", "--format=fp32"])
    exported, _ = load_portable(str(tmp_path / "fp32"))
    assert exported.keys() <= state.keys() and all(torch.equal(v, state[k]) for k, v in exported.items())
    # the checkpoint as an older nanofp8 wrote it: one ckpt.pt holding every rank's shard
    old = load_checkpoint(newest_checkpoint(out))
    moments = fp32_moments(with_shards(dict(old), find_checkpoint(out)[0]))
    old["optimizer"] = {"zero_shards": [load_checkpoint(newest_checkpoint(out, f"optimizer-rank{r}.pt"),
                                                        keys=())["optimizer"] for r in range(2)]}
    os.makedirs(tmp_path / "old")
    save_checkpoint(old, str(tmp_path / "old" / "ckpt.pt"))
    old_state, old_info = read_checkpoint(str(tmp_path / "old"))
    assert old_info["layout"]["zero_world"] == 2 and old_state.keys() == state.keys()
    assert all(torch.equal(old_state[k], v) for k, v in state.items())
    old_moments = fp32_moments(load_checkpoint(str(tmp_path / "old" / "ckpt.pt")))
    assert all(torch.equal(old_moments[k][t], m[t]) for k, m in moments.items() for t in m)
    # O3 on 1 rank: the masters and moments glued from 2 shards and cut into 1
    printed = torchrun(1, "precision=O3", f"out_dir={out}", "init_from=resume", "max_iters=4")
    assert "(precision=O3 (2 ZeRO shards)) to precision=O3 (1 ZeRO shard)" in printed, printed
    shard = load_checkpoint(newest_checkpoint(out, "optimizer-rank0.pt"), keys=("optimizer",))["optimizer"]
    assert shard["zero"]["world_size"] == 1 and shard["state"][0]["step"] == 4  # Adam's count went on
    # and O2 in a plain process
    o2 = train.main(TINY + ["precision=O2", f"out_dir={out}", "init_from=resume", "max_iters=5"])
    printed = capsys.readouterr().out
    assert "(precision=O3 (1 ZeRO shard)) to precision=O2" in printed, printed
    assert "Adam moments (re-stored" in printed
    assert [it for it, _ in o2["losses"]] == [4]
    assert load_checkpoint(newest_checkpoint(out))["optimizer"]["state"][0]["step"] == 5


@pytest.mark.slow
@pytest.mark.dist
def test_tp2_to_one_process(tmp_path, capsys):
    """TP=2 (one file per rank): sample.py merges the shards, and one process resumes them; its
    evaluation matches the TP run's on the same batches (bf16 GEMMs cut in two: rounding only)."""
    out = str(tmp_path / "tp2")
    tp_val = val_losses(torchrun(2, "precision=bf16", "tensor_parallel=2", f"out_dir={out}"))[-1]
    assert sorted(os.listdir(os.path.dirname(newest_checkpoint(out, "manifest.json")))) == [
        "ckpt-tp0-pp0.pt", "ckpt-tp1-pp0.pt", "manifest.json"]
    sample_runs(out, capsys)
    one = train.main(TINY + ["precision=bf16", f"out_dir={out}", "init_from=resume", "eval_only=True"])
    printed = capsys.readouterr().out
    assert "(precision=bf16 (tensor_parallel=2)) to precision=bf16" in printed, printed
    assert "RE-INITIALIZED: optimizer moments" in printed  # a TP rank's optimizer: not carried
    assert abs(one["evals"][0][2] - tp_val) / tp_val < 2e-3, (one["evals"], tp_val)
    o1 = train.main(TINY + ["precision=O1", f"out_dir={out}", "init_from=resume", "max_iters=5"])
    assert [it for it, _ in o1["losses"]] == [3, 4]
    assert os.path.isfile(newest_checkpoint(out, "ckpt.pt"))


@pytest.mark.parametrize("v_format", ["fp16", "fp8"])
def test_moments_between_levels(v_format):
    """O2's moments (E4M3 m, fp16 or E4M3-sqrt v, with scales) -> fp32 for torch AdamW, exactly
    their dequantized values; and back into a fresh O2 optimizer, re-stored to within FP8 rounding."""
    cfg = train.load_config(TINY + ["precision=O2", f"o2_v_format={v_format}"])
    model_args = {k: cfg[k] for k in MODEL_KEYS} | {"vocab_size": 84}

    def built(level):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**model_args))
        train.setup_precision(model, {**cfg, "precision": level}, "cpu")
        return model, train.build_optimizer(model, {**cfg, "precision": level}, "cpu")

    o2, opt = built("O2")
    x = torch.randint(0, 84, (4, 32), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        o2(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    ckpt = {"optimizer": opt.state_dict(), "model": o2.state_dict(), "model_args": model_args,
            "config": {"o2_v_format": v_format}}
    moments = fp32_moments(ckpt)
    lin = o2.blocks[1].mlp.c_fc
    st = opt.state[lin.weight]
    m = dequantize_blocks(st["exp_avg"], st["exp_avg_scale"])  # (one scale per 128 values)
    v = dequantize_blocks(st["exp_avg_sq"], st["exp_avg_sq_scale"])
    v = v.square() if v_format == "fp8" else v
    bf16, opt32 = built("bf16")
    load_moments(opt32, bf16, moments)
    got = opt32.state[bf16.blocks[1].mlp.c_fc.weight]
    assert torch.allclose(got["exp_avg"], m, rtol=1e-6, atol=0) and torch.allclose(got["exp_avg_sq"], v, rtol=1e-6, atol=0)
    assert got["step"] == 3 and opt32.state[bf16.tok_emb.weight]["step"] == 3
    assert torch.equal(opt32.state[bf16.tok_emb.weight]["exp_avg"], opt.state[o2.tok_emb.weight]["exp_avg"])
    back, opt2 = built("O2")
    load_moments(opt2, back, fp32_moments({**ckpt, "optimizer": opt32.state_dict(), "config": {}}))
    st2 = opt2.state[back.blocks[1].mlp.c_fc.weight]
    assert sqnr(m, dequantize_blocks(st2["exp_avg"], st2["exp_avg_scale"])) > 40  # E4M3 of E4M3 values
    v2 = dequantize_blocks(st2["exp_avg_sq"], st2["exp_avg_sq_scale"])
    assert sqnr(v, v2.square() if v_format == "fp8" else v2) > 40


# ---------------------------------------------------------------- the portable export


def trained_like(seed=0, **kw):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**ARGS, **kw})).eval()
    with torch.no_grad():  # weights of a trained model's spread, not the 0.02 init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def logits(model, x):
    with torch.no_grad():
        return model(x, x)[0]


@pytest.mark.parametrize("arch, n_kv_head", [("gpt2", 0), ("llama", 0), ("llama", 1)])
def test_export_import_identical_logits(tmp_path, arch, n_kv_head):
    model = trained_like(arch=arch, tie_embeddings=arch == "gpt2", n_kv_head=n_kv_head)
    x = torch.randint(0, ARGS["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    # fp32: lossless
    export_portable(model.state_dict(), model.config.__dict__, str(tmp_path / "fp32"), fp8=False)
    state, meta = load_portable(str(tmp_path / "fp32"))
    back = GPT(GPTConfig(**meta["model_args"])).eval()
    load_model_state(back, state)
    assert torch.equal(logits(back, x), logits(model, x))
    # FP8: what comes back is the frozen FP8 model, to the bit (the same dequantization)
    export_portable(model.state_dict(), model.config.__dict__, str(tmp_path / "fp8"), fp8=True)
    state, meta = load_portable(str(tmp_path / "fp8"))
    back = GPT(GPTConfig(**meta["model_args"])).eval()
    load_model_state(back, state)
    ref = logits(model, x)
    frozen, _ = freeze_fp8(model)
    assert torch.equal(logits(back, x), logits(frozen, x))
    assert sqnr(ref, logits(back, x)) > 25


def test_export_is_plain_safetensors(tmp_path):
    """No pickle, no nanofp8: the header is JSON, the block weights are F8_E4M3 with F32 scales,
    and safetensors + one multiply give the weights back."""
    from safetensors.torch import load_file

    model = trained_like()
    d = str(tmp_path / "exp")
    export_portable(model.state_dict(), model.config.__dict__, d)
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    assert header["blocks.0.attn.c_attn.weight"]["dtype"] == "F8_E4M3"
    assert header["blocks.0.attn.c_attn.weight_scale"]["dtype"] == "F32"
    assert header["blocks.0.attn.c_attn.weight_scale"]["shape"] == [96, 1]
    assert header["tok_emb.weight"]["dtype"] == "F32" and "lm_head.weight" not in header  # tied: once
    assert json.load(open(os.path.join(d, "config.json")))["model_args"]["n_embd"] == 32
    t = load_file(os.path.join(d, "model.safetensors"))
    w = t["blocks.1.mlp.c_fc.weight"].float() * t["blocks.1.mlp.c_fc.weight_scale"]
    assert torch.equal(w, load_portable(d)[0]["blocks.1.mlp.c_fc.weight"])
    assert sqnr(model.blocks[1].mlp.c_fc.weight, w) > 25


def test_bad_export_files(tmp_path):
    from safetensors.torch import load_file, save_file

    model = trained_like()
    d = str(tmp_path / "good")
    export_portable(model.state_dict(), model.config.__dict__, d)
    good = load_file(os.path.join(d, "model.safetensors"))

    def broken(name, tensors):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(open(os.path.join(d, "config.json")).read())
        save_file(tensors, str(bad / "model.safetensors"))
        return str(bad)

    k = "blocks.0.mlp.c_proj.weight"
    with pytest.raises(CheckpointError, match=r"missing \['blocks.0.mlp.c_proj.weight'\]"):
        load_portable(broken("missing", {n: v for n, v in good.items() if n != k}))
    with pytest.raises(CheckpointError, match=rf"{k} is torch.float16, expected torch.float8_e4m3fn"):
        load_portable(broken("dtype", {**good, k: good[k].half()}))
    with pytest.raises(CheckpointError, match=rf"{k}_scale is torch.float64, expected torch.float32"):
        load_portable(broken("scale_dtype", {**good, k + "_scale": good[k + "_scale"].double()}))
    with pytest.raises(CheckpointError, match=r"tok_emb.weight has shape \(83, 32\), expected \(84, 32\)"):
        load_portable(broken("shape", {**good, "tok_emb.weight": good["tok_emb.weight"][:83].clone()}))
    with pytest.raises(CheckpointError, match=r"unexpected \['extra'\]"):
        load_portable(broken("extra", {**good, "extra": torch.zeros(1)}))
    nan = good["norm_f.weight"].clone()
    nan[3] = float("nan")
    with pytest.raises(CheckpointError, match="norm_f.weight holds NaN"):
        load_portable(broken("nan", {**good, "norm_f.weight": nan}))
    trunc = broken("truncated", good)
    data = open(os.path.join(trunc, "model.safetensors"), "rb").read()
    open(os.path.join(trunc, "model.safetensors"), "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_portable(trunc)
    os.remove(os.path.join(trunc, "config.json"))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_portable(trunc)
    (tmp_path / "truncated" / "config.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="is not a nanofp8 export"):
        load_portable(trunc)
    # and a model with a NaN is not exported in the first place
    state = model.state_dict()
    state["blocks.1.attn.c_proj.weight"][0, 0] = float("inf")
    with pytest.raises(CheckpointError, match="blocks.1.attn.c_proj.weight holds NaN or inf"):
        export_portable(state, model.config.__dict__, str(tmp_path / "inf"))
    with pytest.raises(CheckpointError, match="blocks.1.attn.c_proj.weight holds NaN or inf"):
        export_hf_gpt2(state, model.config.__dict__, str(tmp_path / "inf"))


def test_export_cli_and_finetune_from_it(tmp_path, capsys):
    """export.py from a run, sample.py and train.py init_from=<export> (fine-tuning in O2)."""
    run = str(tmp_path / "run")
    train.main(TINY + ["precision=O1", f"out_dir={run}"])
    exp = str(tmp_path / "exported")
    export.main([f"--out_dir={run}", f"--to={exp}"])
    assert "exported" in capsys.readouterr().out
    sample_runs(exp, capsys)
    ft = train.main(TINY + ["precision=O2", f"init_from={exp}", f"out_dir={tmp_path / 'ft'}", "max_iters=2"])
    assert "fine-tuning the weights of" in capsys.readouterr().out
    assert [it for it, _ in ft["losses"]] == [0, 1]
    # its first evaluation is the exported (FP8-weight) model's, not a fresh one's (~4.4 = ln 84)
    assert ft["evals"][0][2] < 4.2
    # a training run's out_dir (any level) is a starting point too
    ft2 = train.main(TINY + ["precision=bf16", f"init_from={run}", f"out_dir={tmp_path / 'ft2'}", "max_iters=1"])
    assert abs(ft2["evals"][0][2] - ft["evals"][0][2]) < 0.02  # the same model, FP8 weights or not


# ---------------------------------------------------------------- Hugging Face GPT-2


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    import transformers  # a test-only requirement (requirements.txt)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    d = str(tmp_path_factory.mktemp("hf"))
    model.save_pretrained(d)
    return transformers, model, d


def test_hf_gpt2_in(hf_gpt2):
    _, hf, d = hf_gpt2
    state, model_args = load_hf_gpt2(d)
    ours = GPT(GPTConfig(**model_args)).eval()
    load_model_state(ours, state)
    x = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(x).logits
    diff = (logits(ours, x) - ref).abs().max().item()
    print(f"HF -> nanofp8: logits max diff {diff:.2e}")
    assert diff < 1e-4
    model, info = load_for_inference(d)  # what sample.py and init_from=<dir> read
    assert "Hugging Face GPT-2" in info["source"] and torch.equal(logits(model, x), logits(ours, x))


@pytest.mark.parametrize("tied,bias", [(True, True), (False, False)])
def test_hf_gpt2_out(hf_gpt2, tmp_path, tied, bias):
    transformers, _, _ = hf_gpt2
    ours = trained_like(tie_embeddings=tied, bias=bias)
    export_hf_gpt2(ours.state_dict(), ours.config.__dict__, str(tmp_path))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    x = torch.randint(0, 84, (3, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(x).logits - logits(ours, x)).abs().max().item()
    print(f"nanofp8 -> HF (tied={tied}, bias={bias}): logits max diff {diff:.2e}")
    assert diff < 1e-4
    state, _ = load_hf_gpt2(str(tmp_path))  # and back
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())


def test_hf_bad_inputs(hf_gpt2, tmp_path):
    _, _, d = hf_gpt2
    cfg = json.load(open(os.path.join(d, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(CheckpointError, match="activation_function='relu'"):
        load_hf_gpt2(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    os.symlink(os.path.join(d, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \['blocks.2"):
        load_hf_gpt2(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_head": 3}))
    with pytest.raises(CheckpointError, match="n_embd=32 is not divisible by n_head=3"):
        load_hf_gpt2(str(tmp_path))
    with pytest.raises(ValueError, match="arch='gpt2'"):
        export_hf_gpt2({}, GPTConfig(**ARGS, arch="llama").__dict__, str(tmp_path / "x"))
    gqa = trained_like(n_kv_head=1)  # a gpt2 with grouped-query attention: HF's GPT-2 has none
    with pytest.raises(ValueError, match="no grouped-query attention, this model has n_kv_head=1") as e:
        export_hf_gpt2(gqa.state_dict(), gqa.config.__dict__, str(tmp_path / "y"))
    assert "\n" not in str(e.value)


def test_finetune_hf_gpt2(hf_gpt2, tmp_path, capsys):
    """init_from=<Hugging Face dir>: the GPT-2 (vocabulary 96 >= the data's 84) trains in FP8."""
    _, _, d = hf_gpt2
    hist = train.main(TINY + ["precision=O1", f"init_from={d}", f"out_dir={tmp_path}", "max_iters=2"])
    out = capsys.readouterr().out
    assert "fine-tuning the weights of" in out and "vocab_size=96 from the checkpoint" in out
    assert [it for it, _ in hist["losses"]] == [0, 1]


# ---------------------------------------------------------------- Hugging Face LLaMA


def rel_err(ref, approx):
    """|approx - ref| / |ref| over the whole tensor (Frobenius norms)."""
    return ((approx.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A LlamaForCausalLM made by transformers itself (random init, no download), saved with
    save_pretrained: RoPE base 500000 (LLaMA 3's), an untied head, an MLP width of its own."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=32, rms_norm_eps=1e-5,
                                   rope_theta=500000.0,  # (transformers 4; 5 moves it into rope_parameters)
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = str(tmp_path_factory.mktemp("hf-llama"))
    model.save_pretrained(d)
    return transformers, model, d


@pytest.fixture(scope="module")
def hf_llama3(tmp_path_factory):
    """A Llama-3-shaped LlamaForCausalLM made by transformers (random init, no download): its
    vocabulary of 128,256 tokens, RoPE base 500000, grouped-query attention (4 query heads, 2
    key/value heads), an untied head; tiny everywhere else."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   rms_norm_eps=1e-5, rope_theta=500000.0,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = str(tmp_path_factory.mktemp("hf-llama3"))
    model.save_pretrained(d)
    return transformers, model, d


def test_hf_llama3_grouped_query_in_and_out(hf_llama3, tmp_path):
    """A Llama-3-shaped model imports with n_kv_head=2 and computes transformers' logits to fp32
    rounding (token ids above 65,535 included); exported again, transformers reads
    num_key_value_heads=2 and the very tensors it wrote."""
    transformers, hf, d = hf_llama3
    state, model_args = load_hf_llama(d)
    assert (model_args["n_kv_head"], model_args["vocab_size"], model_args["rope_theta"]) == (2, 128256, 500000.0)
    ours = GPT(GPTConfig(**model_args)).eval()
    load_model_state(ours, state)
    x = torch.randint(0, 128256, (2, 32), generator=torch.Generator().manual_seed(2))
    assert x.max() > 65535
    with torch.no_grad():
        err = rel_err(hf(x).logits, logits(ours, x))
    print(f"HF Llama-3-shaped GQA -> nanofp8: logits relative error {err:.1e}")
    assert err < 1e-5
    export_hf_llama(ours.state_dict(), ours.config.__dict__, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["num_key_value_heads"] == 2
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert back.state_dict().keys() == hf.state_dict().keys()
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in back.state_dict().items())


def test_hf_llama_in(hf_llama):
    """transformers' own Llama imports (init_from=<dir> and sample.py read it the same way), and
    computes the same logits here to fp32 rounding."""
    _, hf, d = hf_llama
    state, model_args = load_hf_llama(d)
    assert model_args["rope_theta"] == 500000.0 and model_args["mlp_hidden"] == 160
    ours = GPT(GPTConfig(**model_args)).eval()
    load_model_state(ours, state)
    x = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(x).logits
    err = rel_err(ref, logits(ours, x))
    print(f"HF Llama -> nanofp8: logits relative error {err:.1e}")
    assert err < 1e-5
    model, info = load_for_inference(d)
    assert "Hugging Face LLaMA" in info["source"] and torch.equal(logits(model, x), logits(ours, x))


@pytest.mark.parametrize("tied, n_kv_head", [(True, 0), (False, 0), (False, 1)])
def test_hf_llama_out_and_back(hf_llama, tmp_path, tied, n_kv_head):
    """nanofp8 -> LlamaForCausalLM: every tensor of the HF model is loaded (none missing, none left
    over), logits within 1e-5 relative in fp32; and back to nanofp8 bit for bit. With grouped-query
    attention (n_kv_head=1 for 2 query heads) num_key_value_heads carries it both ways."""
    transformers, _, _ = hf_llama
    ours = trained_like(arch="llama", tie_embeddings=tied, rope_theta=5000.0, n_kv_head=n_kv_head)
    export_hf_llama(ours.state_dict(), ours.config.__dict__, str(tmp_path))
    hf, loading = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(loading.values()), loading  # missing, unexpected, mismatched: none
    assert hf.config.num_key_value_heads == ours.config.kv_heads
    x = torch.randint(0, 84, (3, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = rel_err(logits(ours, x), hf.eval()(x).logits)
    print(f"nanofp8 -> HF Llama (tied={tied}): logits relative error {err:.1e}")
    assert err < 1e-5
    state, model_args = load_hf_llama(str(tmp_path))
    arch = lambda c: (c.block_size, c.vocab_size, c.n_layer, c.n_head, c.kv_heads, c.n_embd, c.hidden,  # noqa: E731
                      c.has_bias, c.tie_embeddings, c.rope_theta, c.norm_eps)
    assert arch(GPTConfig(**model_args)) == arch(ours.config)
    assert state.keys() == ours.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())


def test_hf_llama_cli_and_finetune(hf_llama, tmp_path, capsys):
    """export.py --format=hf of a llama (here a portable export of one, with grouped-query
    attention), read back bit for bit, and train.py init_from=<HF Llama dir> fine-tunes it in FP8."""
    _, _, d = hf_llama
    model = trained_like(arch="llama", n_kv_head=1)  # grouped-query attention: num_key_value_heads=1
    export_portable(model.state_dict(), model.config.__dict__, str(tmp_path / "portable"), fp8=False)
    export.main([f"--out_dir={tmp_path / 'portable'}", f"--to={tmp_path / 'hf'}", "--format=hf"])
    hf_config = json.load(open(tmp_path / "hf" / "config.json"))
    assert hf_config["architectures"] == ["LlamaForCausalLM"] and hf_config["num_key_value_heads"] == 1
    state, model_args = load_hf_llama(str(tmp_path / "hf"))
    assert model_args["n_kv_head"] == 1 and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    hist = train.main(TINY + ["precision=O1", "arch=llama", f"init_from={d}", f"out_dir={tmp_path / 'ft'}",
                              "max_iters=2"])
    out = capsys.readouterr().out
    assert "fine-tuning the weights of" in out and "vocab_size=96 from the checkpoint" in out
    assert [it for it, _ in hist["losses"]] == [0, 1]



LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def test_hf_llama3_rope_scaling_both_ways(hf_llama, tmp_path):
    """Llama 3.1's rescaled RoPE, as transformers 5 writes it (rope_parameters) and as older files do
    (rope_theta + rope_scaling, type under "type"): imported into GPTConfig.rope_scaling, logits as
    transformers' own; exported, transformers reads the same scaling back. The scaling is large
    here (an original context of 16 positions in 128): an importer that dropped it misses by more
    than 100x the bound."""
    transformers, _, _ = hf_llama
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
                                   rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0},
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path / "new"))
    old = json.load(open(tmp_path / "new" / "config.json"))  # the same model, an older transformers' config
    old.pop("rope_parameters")
    old.update(rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "type": LLAMA3_ROPE["rope_type"]})
    old["rope_scaling"].pop("rope_type")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    os.symlink(tmp_path / "new" / "model.safetensors", tmp_path / "old" / "model.safetensors")
    x = torch.randint(0, 96, (2, 128), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(x).logits
    for d in ("new", "old"):
        state, model_args = load_hf_llama(str(tmp_path / d))
        assert model_args["rope_scaling"] == LLAMA3_ROPE and model_args["rope_theta"] == 500000.0
        ours = GPT(GPTConfig(**model_args)).eval()
        load_model_state(ours, state)
        err = rel_err(ref, logits(ours, x))
        print(f"HF Llama 3.1 RoPE ({d} config) -> nanofp8: logits relative error {err:.1e}")
        assert err < 1e-5
    unscaled = GPT(GPTConfig(**{**model_args, "rope_scaling": None})).eval()
    load_model_state(unscaled, state)
    assert rel_err(ref, logits(unscaled, x)) > 1e-3  # (observed 5.6e-3: a random model's attention is nearly flat)
    export_hf_llama(ours.state_dict(), ours.config.__dict__, str(tmp_path / "out"))
    back, loading = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not any(loading.values()), loading
    with torch.no_grad():
        err = rel_err(logits(ours, x), back.eval()(x).logits)
    print(f"nanofp8 -> HF with Llama 3.1 RoPE: logits relative error {err:.1e}")
    assert err < 1e-5
    assert load_hf_llama(str(tmp_path / "out"))[1]["rope_scaling"] == LLAMA3_ROPE


class NotATensor:
    """An object a weights_only unpickler refuses (a class it does not know)."""


def test_hf_weights_in_shards_and_pickles(hf_llama, tmp_path):
    """What save_pretrained writes for a larger model, model.safetensors.index.json and its shards,
    and older directories' pytorch_model.bin (one file or shards), read as model.safetensors is; an
    index that does not match its shards, or a pickle holding more than tensors, refused in one line."""
    import safetensors.torch
    _, hf, d = hf_llama
    want = read_hf_weights(d)
    hf.save_pretrained(str(tmp_path / "st"), max_shard_size="40KB")
    assert not os.path.exists(tmp_path / "st" / "model.safetensors")
    index = json.load(open(tmp_path / "st" / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    (tmp_path / "bin").mkdir()
    torch.save(want, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "binshards").mkdir()
    where = {}
    for i, shard in enumerate(shards):
        part = safetensors.torch.load_file(str(tmp_path / "st" / shard))
        torch.save(part, tmp_path / "binshards" / f"pytorch_model-{i}.bin")
        where.update({k: f"pytorch_model-{i}.bin" for k in part})
    (tmp_path / "binshards" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": where}))
    for kind in ("st", "bin", "binshards"):
        got = read_hf_weights(str(tmp_path / kind))
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items()), kind
        (tmp_path / kind / "config.json").write_text(open(os.path.join(d, "config.json")).read())
        state, _ = load_hf_llama(str(tmp_path / kind))  # and the readers of train.py, sample.py, export.py
        assert load_for_inference(str(tmp_path / kind))[1]["source"]
    os.remove(tmp_path / "st" / shards[-1])
    with pytest.raises(CheckpointError, match=f"no {shards[-1]} in"):
        read_hf_weights(str(tmp_path / "st"))
    name = sorted(where)[0]
    (tmp_path / "binshards" / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {**where, name: "pytorch_model-1.bin", "extra.weight": where[name]}}))
    with pytest.raises(CheckpointError, match="does not place there"):
        read_hf_weights(str(tmp_path / "binshards"))
    torch.save({"w": torch.ones(1), "x": NotATensor()}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="cannot read .*pytorch_model.bin as plain tensors") as e:
        read_hf_weights(str(tmp_path / "bin"))
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="no weights in .*model.safetensors.index.json"):
        read_hf_weights(str(tmp_path / "empty-dir-does-not-matter"))


@pytest.mark.parametrize("key,value,says", [
    ("num_key_value_heads", 3, "num_key_value_heads=3: it must divide num_attention_heads=4"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     "rope_parameters={.*}: RoPE of type 'yarn' is not implemented"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling={.*}: RoPE of type 'linear'"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
     r"RoPE of type 'llama3' needs \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]"),
    ("rope_parameters", {**LLAMA3_ROPE, "rope_theta": 1e4, "low_freq_factor": 4.0},
     "rope_scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor"),
    ("attention_bias", True, "attention_bias=True: LLaMA's Linears have no biases"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu': the SwiGLU MLP here gates with silu only"),
    ("head_dim", 32, "head_dim=32: a head here is hidden_size / num_attention_heads wide"),
])
def test_hf_llama_refused(hf_llama, tmp_path, key, value, says):
    """A Llama config that our model does not compute is refused in one line naming the key."""
    _, _, d = hf_llama
    cfg = json.load(open(os.path.join(d, "config.json")))
    if key == "rope_scaling":  # an older transformers' file: rope_theta and rope_scaling
        cfg.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
    os.symlink(os.path.join(d, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=says) as e:
        load_hf_llama(str(tmp_path))
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=says):
        load_for_inference(str(tmp_path))  # init_from and sample.py: the same refusal


# ---------------------------------------------------------------- FP8 in the Hugging Face layout


def fp8_llama(**kw):
    """A llama whose fused matrices split on 128-row tile edges (n_embd 128, MLP width 512)."""
    return trained_like(**{"arch": "llama", "n_embd": 128, "n_head": 2, "tie_embeddings": False, **kw})


def trained_bytes(model, recipe):
    """{our block Linear: its FP8 weight cast (data, dequantization scale)} as the recipe's GEMMs
    read it in training."""
    from nanofp8.fp8 import Recipe

    apply_fp8(model, Recipe.from_name(recipe, backend="emulate"))
    return {n: (lambda q: (q.data, q.inv_scale))(m.cast_weight()[0]) for n, m in model.named_modules()
            if n.startswith("blocks.") and hasattr(m, "cast_weight")}


def check_fp8_file(d, model, recipe, scale_name):
    """The export holds the recipe's trained E4M3 bytes and fp32 dequantization scales, split as
    LLAMA_BLOCK splits the fused matrices."""
    from safetensors.torch import load_file

    from nanofp8.interop import LLAMA_BLOCK

    t = load_file(os.path.join(d, "model.safetensors"))
    for name, (data, scale) in trained_bytes(copy.deepcopy(model), recipe).items():
        i, ours = name.split(".", 2)[1:]
        parts = dict(LLAMA_BLOCK)[ours]
        got = [t[f"model.layers.{i}.{p}.weight"] for p in parts]
        assert all(g.dtype == torch.float8_e4m3fn for g in got)
        assert torch.equal(torch.cat(got).view(torch.uint8), data.view(torch.uint8)), name
        scales = [t[f"model.layers.{i}.{p}.{scale_name}"] for p in parts]
        assert all(s.dtype == torch.float32 for s in scales) and torch.equal(torch.cat(scales), scale), name
    assert all(v.dtype == torch.float32 for k, v in t.items() if not k.startswith("model.layers.")
               or k.endswith("layernorm.weight"))  # embeddings, norms, LM head (if untied)


@pytest.mark.parametrize("n_kv_head", [0, 1])
def test_hf_fp8_rowwise_compressed_tensors(hf_llama, tmp_path, n_kv_head):
    """--format=hf-fp8 of a rowwise run: compressed-tensors' float-quantized, which transformers
    loads with the weights still float8_e4m3fn, and runs as nanofp8's rowwise FP8 model runs: the
    same weight bytes and scales, activations cast to E4M3 per token at run time.

    Bound: 60 dB. The two compute with the same FP8 weights and the same per-token activation casts,
    so they differ by fp32 rounding (order of sums: ~2^-24 relative, ~140 dB), and by what that
    rounding does to an activation sitting on an E4M3 rounding edge: its byte flips, moving it one
    E4M3 step (2^-3 of its binade). A fraction p of flipped values is a noise power of about p * 2^-6
    of the signal, SQNR 18 - 10 log10(p) dB: 60 dB allows fewer than 1 value in ~10^4 flipped.
    Measured: ~130 dB (no flip)."""
    transformers, _, _ = hf_llama
    model = fp8_llama(n_kv_head=n_kv_head)  # 1: grouped-query attention, k and v half of q's rows
    export_hf_llama(model.state_dict(), model.config.__dict__, str(tmp_path), fp8="row")
    check_fp8_file(str(tmp_path), model, "rowwise", "weight_scale")
    q = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert (q["quant_method"], q["format"], q["ignore"]) == ("compressed-tensors", "float-quantized", ["lm_head"])
    group = q["config_groups"]["group_0"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "strategy", "symmetric", "dynamic")} == \
        {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    assert (group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) == ("token", True)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn  # kept FP8 on load
    assert hf.model.layers[0].self_attn.q_proj.weight_scale.shape == (128, 1)
    assert hf.model.layers[0].self_attn.k_proj.weight_scale.shape == (128 // (2 // model.config.kv_heads), 1)
    assert hf.lm_head.weight.dtype == torch.float32
    ours = copy.deepcopy(model)
    trained_bytes(ours, "rowwise")  # (converts ours to the rowwise FP8 model)
    x = torch.randint(0, 84, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        db = sqnr(logits(ours, x), hf(x).logits)
    print(f"compressed-tensors FP8 (transformers) vs nanofp8 rowwise FP8: logits SQNR {db:.1f} dB")
    assert db > 60


def test_hf_fp8_blockwise_finegrained(hf_llama, tmp_path):
    """--format=hf-fp8 of a blockwise run: transformers' fp8 (FineGrainedFP8) with 128x128 tiles and
    weight_scale_inv. On a CPU transformers dequantizes these weights on load (its FP8 GEMMs need a
    GPU) and runs them without activation casts: what freeze_fp8(model, "block") computes.

    Bound: 100 dB, the 1e-5 relative error of the fp32 exports (test_hf_llama_out_and_back): the
    same E4M3 bytes times the same fp32 tile scales give the same fp32 weights, and no cast sits in
    between, so only fp32 rounding remains. Measured: ~125 dB."""
    transformers, _, _ = hf_llama
    model = fp8_llama()
    export_hf_llama(model.state_dict(), model.config.__dict__, str(tmp_path), fp8="block")
    check_fp8_file(str(tmp_path), model, "blockwise", "weight_scale_inv")
    q = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"], q["modules_to_not_convert"]) == ("fp8", [128, 128], ["lm_head"])
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    # read as fp8 tiles and dequantized on load (on a GPU they stay float8_e4m3fn in its FP8Linear)
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    frozen, _ = freeze_fp8(copy.deepcopy(model), "block")
    x = torch.randint(0, 84, (2, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        db = sqnr(logits(frozen, x), hf(x).logits)
    print(f"fine-grained FP8 (transformers, dequantized on CPU) vs nanofp8 frozen block FP8: logits SQNR {db:.1f} dB")
    assert db > 100
    with pytest.raises(ValueError, match="multiples of 128"):  # a 128x128 tile would straddle q and k
        export_hf_llama(trained_like(arch="llama").state_dict(), GPTConfig(**ARGS, arch="llama").__dict__,
                        str(tmp_path / "x"), fp8="block")
    gqa = fp8_llama(n_kv_head=1)  # k and v of 64 rows each: a tile would straddle k and v
    with pytest.raises(ValueError, match=r"the key/value width \(64\) to be multiples of 128"):
        export_hf_llama(gqa.state_dict(), gqa.config.__dict__, str(tmp_path / "y"), fp8="block")


def test_hf_fp8_cli(tmp_path, capsys):
    """export.py --format=hf-fp8: a rowwise O1 run's own bytes with no note; an export that records
    no recipe gets row scales cast now, and says so; GPT-2 is refused in one line with the reason."""
    run = str(tmp_path / "run")
    train.main(TINY + ["precision=O1", "arch=llama", "n_embd=64", "fp8_recipe=rowwise", f"out_dir={run}"])
    capsys.readouterr()
    export.main([f"--out_dir={run}", f"--to={tmp_path / 'hf'}", "--format=hf-fp8"])
    assert "note:" not in capsys.readouterr().out
    ours, _ = load_for_inference(run)
    check_fp8_file(str(tmp_path / "hf"), ours, "rowwise", "weight_scale")
    model = trained_like(arch="llama")
    export_portable(model.state_dict(), model.config.__dict__, str(tmp_path / "portable"), fp8=False)
    export.main([f"--out_dir={tmp_path / 'portable'}", f"--to={tmp_path / 'hf2'}", "--format=hf-fp8"])
    assert "note: the run's weights were not cast as an HF FP8 format stores them (no FP8 recipe recorded)" \
        in capsys.readouterr().out
    gpt2 = trained_like()
    export_portable(gpt2.state_dict(), gpt2.config.__dict__, str(tmp_path / "gpt2"), fp8=False)
    with pytest.raises(ConfigError, match=r"--format=hf-fp8 needs arch=llama: GPT-2's Conv1D stores each matrix "
                                          r"transposed, \(in, out\), so a scale per row of W would be per column") as e:
        export.main([f"--out_dir={tmp_path / 'gpt2'}", f"--to={tmp_path / 'hf3'}", "--format=hf-fp8"])
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- frozen FP8 models


@pytest.mark.parametrize("granularity", ["row", "tensor", "block"])
def test_freeze_fp8(granularity):
    model = trained_like(n_embd=128, n_head=4)
    x = torch.randint(0, 84, (2, 32), generator=torch.Generator().manual_seed(4))
    ref = logits(model, x)
    frozen, st = freeze_fp8(model, granularity)
    rows = 2 * (3 * 128 + 128 + 4 * 128 + 128)  # out features of the 4 Linears, 2 blocks
    n_scales = {"row": rows, "tensor": 8, "block": 2 * (3 + 1 + 4 + 4)}[granularity]
    assert st["weights"] == 2 * 12 * 128 * 128 and st["bf16"] == 2 * st["weights"]
    assert st["fp8"] == st["weights"] + 4 * n_scales  # 1 byte per weight + the fp32 scales
    assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert sqnr(ref, logits(frozen, x)) > 20  # E4M3 weights through 2 blocks: ~25 dB


def test_bench_memory_frozen(tmp_path):
    """bench.py memory's frozen-model table: 1 byte per block weight + 4 per row scale, vs 2 in bf16."""
    import argparse

    import bench

    out = tmp_path / "memory.json"
    out.write_text("{}")  # cmd_memory writes the file first; this table is added to it
    bench.cmd_memory_frozen(argparse.Namespace(models=["tiny"], llama_layers=2, json=str(out)))
    rows = {r["granularity"]: r for r in json.loads(out.read_text())["memory_frozen_fp8"]}
    weights, rows_ = 2 * 12 * 64 * 64, 2 * 9 * 64  # tiny: 2 blocks of width 64
    assert rows["row"]["linear_fp8_B_per_weight"] == (weights + 4 * rows_) / weights
    assert rows["row"]["linear_fp8_vs_bf16"] == (weights + 4 * rows_) / (2 * weights)
    assert rows["block"]["linear_fp8_vs_bf16"] < rows["row"]["linear_fp8_vs_bf16"] < 0.53
    assert rows["row"]["model_fp8_MB"] < rows["row"]["model_bf16_MB"]


def test_o1_run_to_transformers(hf_gpt2, tmp_path, capsys):
    """export.py --format=hf on a training run (O1: FP8 scaling buffers, which are not exported)."""
    transformers, _, _ = hf_gpt2
    run = str(tmp_path / "run")
    train.main(TINY + ["precision=O1", "bias=False", f"out_dir={run}"])
    export.main([f"--out_dir={run}", f"--to={tmp_path / 'hf'}", "--format=hf"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    ours, _ = load_for_inference(run)
    x = torch.randint(0, 84, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (hf(x).logits - logits(ours, x)).abs().max() < 1e-4
