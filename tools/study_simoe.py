"""SIMoE study: instruction-tune one small dense model four ways and check SIMoE's claims.

    python tools/study_simoe.py [--out runs/study_simoe] [--quick] [--jobs N] [--runs DIR]
                                [--cache-dir DIR]

Results go to runs/ unless `--out` says otherwise; the published full study is
`--out docs/study_simoe`, so a `--quick` check never overwrites it.

Two seeds (one with --quick), each with its own generated task set and tuning order:
1. A dense GPT (configs/simoe_dense_seed.yaml) is pretrained on the default corpus blended
   half and half with facts of every task family, seen and unseen, stated as prose
   (megamoe.instruct.tasks.write_knowledge_corpus): like the language models instruction tuning
   starts from, the seed has met the held-out tasks in pretraining, and the unseen families
   test whether tuning carries that knowledge into the tuning template. (On the default corpus
   alone no method answered more than 4 % of them; with the blend, still under 5 %: the small
   seed learns few of the unseen families' rules even as prose: a pilot seed answered
   last_letter's prose questions 82 % of the time, the other three 5 % or less.)
2. It is instruction-tuned on the seen task families of megamoe's generated instruction set
   (megamoe.instruct.tasks) for 5 epochs, with the same data, order and schedule
   (configs/simoe_instruct.yaml; SIMoE with its defaults, the settings of SMAT and the paper):
   (a) full fine-tuning, (b) LoRA at the rank whose factors hold as many parameters as SIMoE's
   delta, (c) sparse upcycling to 4 experts top-2 (tools/upcycle_ckpt.py) then full fine-tuning,
   (d) SIMoE (arXiv 2506.12597), every run through `python -m megamoe.train`, `--jobs` at a time.
   Methods differ in the learning rate they want (LoRA's factors and SIMoE's masked delta move
   the weights otherwise than full fine-tuning does), so each tunes at its own: on the first
   seed every method runs at each rate of a grid (by default 1e-3, 3e-3 and 1e-2: the config's
   rate and factors of 3 above it; at 3e-4 every method scored below its rate at 1e-3, and
   SIMoE chose the top of a grid ending at 3e-3), and the rate whose run scores best on a
   validation split (new examples of the seen families, neither trained on nor reported) is the
   one its row reports and the later seeds use. The unseen families take no part in the choice.
   SIMoE's masks keep their own rate whatever the grid's (SMAT trains them with an optimizer of
   their own): `mask_lr_scale` x the config's rate, so the grid tunes its delta and router as it
   tunes the other methods' weights (a mask rate scaled with the grid's drove the masks below
   their target: served density 0.177 for 0.25 at 3e-3).
3. Each is scored by exact match on new examples of the seen families and on the unseen
   families (200 of each family per seed; the claims give binomial standard errors); the table
   has seen / unseen accuracy, trainable and inference parameters (active per token or
   sequence, and stored) and wall time; SIMoE's learned masks are plotted (density per layer
   and module type, pairwise overlap, as served) with its router's coefficients per task family.
   The table gives the mean over seeds and each seed's figure.
Claims, each printed as held or not (on the means): SIMoE generalises to unseen families at least
as well as full fine-tuning; it beats LoRA of as many trainable parameters on the seen families;
its served masks reach the target sparsity (within 0.02); different families get
different merging coefficients; its masks overlap less than independent masks of the same
density would. Nothing is tuned towards them. Writes OUT/study.md, OUT/study.json and the PNGs
atomically; the runs train in a temporary folder that is removed, or with `--runs DIR` in
DIR/seed<k>, kept, where a rerun (after a crash, say) reuses every run that finished with the
same command. OUT, DIR and each seed folder are marked as the study's (megamoe.ownership): it
replaces only folders it marked (or empty ones), refuses any other in one line before anything
trains, and refuses a run it cannot read (a malformed record or metrics.jsonl) in one line.
`--quick` (CI) runs every step at a few iterations: it checks the pipeline, not the claims.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from megamoe.bounded import bounded_lines, parse_json, read_bounded, read_json  # noqa: E402
from megamoe.children import end_children_on_sigterm, run_child  # noqa: E402
from megamoe.errors import (CliArgumentParser, ConfigError, DataError, int_at_least,  # noqa: E402
                            run_cli)
from megamoe.ownership import (check_folder_output, claim_folder, fresh_folder,  # noqa: E402
                               replace_folder)
from megamoe.paths import refuse_overlap  # noqa: E402

SEED_CONFIG = ROOT / "configs" / "simoe_dense_seed.yaml"
INSTRUCT_CONFIG = ROOT / "configs" / "simoe_instruct.yaml"
MOE = {"experts": 4, "topk": 2}
METHODS = ("simoe", "full", "lora", "sparse_upcycling")
# 200 evaluation examples per family and seed: at 40, the unseen comparison turned on 2 of 320
# examples, well inside its binomial standard error (about 0.011).
FULL = {"seed_steps": 2000, "knowledge_documents": 4000, "tune_epochs": 5,
        "per_family_train": 300, "per_family_eval": 200,
        "per_family_valid": 40, "seeds": 2, "learning_rates": (1.0e-3, 3.0e-3, 1.0e-2)}
QUICK = {"seed_steps": 4, "knowledge_documents": 8, "tune_steps": 3, "per_family_train": 4,
         "per_family_eval": 2, "per_family_valid": 2, "seeds": 1, "learning_rates": (1.0e-3,)}
MIN_LR_RATIO = 0.1  # optimizer.min_lr = this x the run's learning rate (the config's 1e-4 / 1e-3)
SEED_BASE = 1234  # training.seed of replicate 0 (the trainer's default); replicate k: + k
CACHE: list[str] = []  # the data.cache_dir override of every run (--cache-dir)
RUN_ENV = {"TORCHDYNAMO_DISABLE": "1"}  # + OMP_NUM_THREADS when runs share the cores (--jobs)
SIZES_STAMP = "study_sizes.json"  # in each --runs seed folder: the sizes its runs trained at
_TRAINABLE = re.compile(r"([\d,]+) of ([\d,]+) parameters train")
TOOL = "study_simoe"  # the name its folders are marked with
MAX_RECORD_BYTES = 64 * 2**20  # a run's record (its command and stdout) or one metrics line


def run(command: list[str], label: str, output: Path) -> tuple[str, float]:
    """Run a megamoe command that writes `output` to completion; its stdout and wall seconds
    (exit 2 on failure). Both are kept in `output`.study_run.json, written last: a later study
    in the same --runs folder reuses a run whose record holds the same command, and starts any
    other over."""
    record = output.with_name(output.name + ".study_run.json")
    if record.is_file():
        kept = read_json(record, MAX_RECORD_BYTES, DataError)
        if not (isinstance(kept, dict) and isinstance(kept.get("stdout"), str)
                and type(kept.get("seconds")) in (int, float)):
            raise DataError(f"{record} is not a study_simoe run record; remove it (and "
                            f"{output.name}) to run again")
        if kept.get("command") == command:
            print(f"[{label}] reusing the finished run in {output}", flush=True)
            return kept["stdout"], kept["seconds"]
        record.unlink()
    shutil.rmtree(output, ignore_errors=True)
    print(f"[{label}] {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    done = run_child([sys.executable, *command], echo_prefix=f"[{label}] ", cwd=ROOT,
                     env={**os.environ, **RUN_ENV})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(f"[{label}] failed (exit {done.returncode}):\n{done.stderr[-3000:]}\n")
        sys.exit(2)
    print(f"[{label}] done in {seconds:.0f} s", flush=True)
    partial = record.with_name(record.name + ".partial")
    partial.write_text(json.dumps({"command": command, "stdout": done.stdout,
                                   "seconds": seconds}))
    os.replace(partial, record)
    return done.stdout, seconds


def train(config: Path, out: Path, overrides: list[str], label: str) -> tuple[dict, str, float]:
    """One training run; (its last metrics record, stdout, seconds)."""
    stdout, seconds = run(["-m", "megamoe.train", "--config", str(config), f"output_dir={out}",
                           "logging.progress_bar=false", "logging.tensorboard=false",
                           *CACHE, *overrides], label, out)
    return last_record(out / "metrics.jsonl"), stdout, seconds


def last_record(metrics: Path) -> dict:
    """The last record of a run's metrics.jsonl, read line by line within MAX_RECORD_BYTES; a
    file without one, or a line that is not a JSON object, is a one-line DataError."""
    last = None
    for number, line in bounded_lines(metrics, MAX_RECORD_BYTES, DataError, str(metrics)):
        if line.strip():
            last = parse_json(line, DataError, f"{metrics} line {number}")
            if not isinstance(last, dict):
                raise DataError(f"{metrics} line {number} is not a metrics record (a JSON "
                                "object); remove the run to train it again")
    if last is None:
        raise DataError(f"{metrics} holds no metrics record; remove the run to train it again")
    return last


def parameter_counts(stdout: str) -> tuple[int, int]:
    """(trainable, total) from the trainer's start-up line."""
    trainable, total = _TRAINABLE.search(stdout).groups()
    return int(trainable.replace(",", "")), int(total.replace(",", ""))


def tune_steps(sizes: dict) -> int:
    """Optimizer steps of each tuning run: `tune_epochs` passes over the training set."""
    from megamoe.instruct import tasks
    from megamoe.train.config import load_config

    if "tune_steps" in sizes:
        return sizes["tune_steps"]
    examples = sizes["per_family_train"] * len(tasks.SEEN_FAMILIES)
    batch = load_config(str(INSTRUCT_CONFIG), []).training.global_batch_size
    return math.ceil(sizes["tune_epochs"] * examples / batch)


def study(quick: bool, jobs: int, learning_rates: tuple[float, ...] = (),
          runs: Path | None = None) -> dict:
    """Every seed of the study, trained in `runs` (reusing its finished runs) or in temporary
    folders; the first seed chooses each method's learning rate."""
    sizes = QUICK if quick else FULL
    grid = tuple(learning_rates) or sizes["learning_rates"]
    delta = simoe_delta_parameters()
    rank = lora_rank_for(delta)
    first = replicate(sizes, 0, {method: grid for method in METHODS}, rank, jobs, runs)
    chosen = {method: (first["rows"][method]["lr"],) for method in METHODS}
    replicates = [first, *(replicate(sizes, seed, chosen, rank, jobs, runs)
                           for seed in range(1, sizes["seeds"]))]
    return {**summarise(replicates, quick, tune_steps(sizes), sizes["per_family_eval"]),
            "learning_rates": list(grid),
            "mask_lr": simoe_mask_lr(), "delta_parameters": delta, "lora_rank": rank,
            "jobs": jobs}


def best_rate(scores: dict[float, float]) -> float:
    """The learning rate whose run scored best on the validation split (the smaller on a tie)."""
    return max(sorted(scores), key=lambda lr: (scores[lr], -lr))


def simoe_mask_lr() -> float:
    """The rate SIMoE's masks learn at in every run: the default `mask_lr_scale` x the config's
    learning rate (SMAT trains the masks with an optimizer of their own)."""
    from megamoe.simoe.config import SIMoEConfig
    from megamoe.train.config import load_config

    return SIMoEConfig().mask_lr_scale * load_config(str(INSTRUCT_CONFIG), []).optimizer.lr


def rate_overrides(method: str, lr: float) -> list[str]:
    """A tuning run's learning rate `lr` (decaying to a tenth); SIMoE's masks at their own."""
    overrides = [f"optimizer.lr={lr}", f"optimizer.min_lr={lr * MIN_LR_RATIO}"]
    if method == "simoe":
        overrides.append(f"finetune.simoe.mask_lr_scale={simoe_mask_lr() / lr!r}")
    return overrides


def check_outputs(out: str, runs: str | None, seeds: int, cache_dir: str | None) -> None:
    """Before anything trains: --out replaceable by the study, and --runs and its seed folders
    the study's (marked), empty or absent, apart from --out, neither around nor inside the
    configs or the corpus cache the study reads; a one-line ConfigError otherwise (nothing
    touched)."""
    inputs = [SEED_CONFIG, INSTRUCT_CONFIG, cache_dir]
    check_folder_output(out, TOOL, "--out", inputs)
    if runs is None:
        return
    refuse_overlap(runs, inputs, "--runs")
    try:
        refuse_overlap(runs, [out], "--runs")
    except ConfigError:
        raise ConfigError(f"--runs {runs} and --out {out} overlap: the study replaces --out "
                          "when it ends; choose folders apart") from None
    for seed in range(seeds):
        check_folder_output(Path(runs) / f"seed{seed}", TOOL, "--runs")
    check_folder_output(runs, TOOL, "--runs")


def _holds(path: Path, text: str) -> bool:
    """Whether the file `path` holds exactly `text` (False when it is missing, larger or not
    a regular file)."""
    try:
        return read_bounded(path, len(text.encode()), DataError, str(path)) == text
    except DataError:
        return False


@contextlib.contextmanager
def seed_folder(runs: Path | None, seed: int, sizes: dict) -> Iterator[Path]:
    """Where one seed trains: a temporary folder, removed afterwards, or runs/seed{seed}, kept
    (emptied first when it holds a study of other sizes)."""
    if runs is None:
        with tempfile.TemporaryDirectory(prefix="study_simoe_") as tmp:
            yield Path(tmp)
        return
    folder, wanted = runs / f"seed{seed}", json.dumps(sizes, sort_keys=True)
    stamp = folder / SIZES_STAMP
    claim_folder(runs, TOOL, "--runs")
    if _holds(stamp, wanted):
        claim_folder(folder, TOOL, "--runs")
    else:
        fresh_folder(folder, TOOL, "--runs")
    stamp.write_text(wanted)
    yield folder


def knowledge_blend(work: Path, sizes: dict, seed: int, label: str) -> list[str]:
    """The dense seed's data overrides: the default corpus blended half and half with a corpus
    of every family's facts as prose (megamoe.instruct.tasks.write_knowledge_corpus), tokenized
    with the default corpus's tokenizer, which the tuning runs read."""
    from megamoe.instruct import tasks
    from megamoe.train.config import load_config
    from megamoe.train.corpus import ensure_default_dataset

    data = load_config(str(SEED_CONFIG), CACHE).data
    corpus, tokenizer = ensure_default_dataset(Path(data.cache_dir).expanduser(),
                                               data.vocab_size)
    text = tasks.write_knowledge_corpus(work / "knowledge.jsonl", sizes["knowledge_documents"],
                                        seed)
    prefix = work / "knowledge"
    run(["tools/preprocess_data.py", "--input", str(text), "--output-prefix", str(prefix),
         "--tokenizer-model", tokenizer], label + "knowledge corpus", prefix)
    return [f"data.prefixes=[{corpus},{prefix}]", "data.weights=[0.5,0.5]",
            f"data.tokenizer_model={tokenizer}"]


def replicate(sizes: dict, seed: int, rates: dict[str, tuple[float, ...]], rank: int,
              jobs: int, runs: Path | None) -> dict:
    """One seed of the study: its own task set and dense seed model; each method tuned at each
    of its `rates`, the run best on the validation split kept."""
    from megamoe.instruct import tasks

    label = f"seed {seed}: "
    seeded = [f"training.seed={SEED_BASE + seed}"]
    with seed_folder(runs, seed, sizes) as work:
        data = tasks.write_instruction_set(work / "data", sizes["per_family_train"],
                                           sizes["per_family_eval"], seed=seed,
                                           per_family_valid=sizes["per_family_valid"])
        _, _, seed_seconds = train(SEED_CONFIG, work / "seed",
                                   [f"training.train_steps={sizes['seed_steps']}", *seeded,
                                    *knowledge_blend(work, sizes, seed, label)],
                                   label + "dense seed")
        run(["tools/upcycle_ckpt.py", "--load", str(work / "seed" / "checkpoints"),
             "--save", str(work / "upcycled"), "--num-experts", str(MOE["experts"]),
             "--topk", str(MOE["topk"]), "--no-progress"], label + "sparse upcycling",
            work / "upcycled")
        tune = [f"training.train_steps={tune_steps(sizes)}", *seeded,
                f"finetune.train_data={data['train']}",
                "finetune.eval_data=[" + ",".join(str(data[split]) for split in
                                                  ("valid_seen", "eval_seen", "eval_unseen")) + "]"]
        seed_init = f"checkpoint.init_from={work / 'seed' / 'checkpoints'}"
        methods = {
            "simoe": ("simoe", [seed_init, "finetune.method=simoe"]),
            "full": ("full fine-tuning", [seed_init, "finetune.method=full"]),
            "lora": (f"LoRA r={rank}", [seed_init, "finetune.method=lora",
                                        f"finetune.lora_rank={rank}",
                                        f"finetune.lora_alpha={2 * rank}"]),
            "sparse_upcycling": ("sparse upcycling 4x top-2", [
                f"checkpoint.init_from={work / 'upcycled'}", "finetune.method=full",
                "model.first_k_dense=0", f"moe.num_experts={MOE['experts']}",
                f"moe.topk={MOE['topk']}", "moe.ffn_hidden_size=384",
                "moe.router.score_function=softmax", "moe.balancing.methods=aux_loss",
                "moe.balancing.aux_loss_coeff=1.0e-2"]),
        }

        def tune_at(job: tuple[str, float]):
            method, lr = job
            name, overrides = methods[method]
            return train(INSTRUCT_CONFIG, work / f"{method}_lr{lr:g}",
                         [*tune, *overrides, *rate_overrides(method, lr)],
                         f"{label}{name} at lr {lr:g}")

        grid = [(method, lr) for method in METHODS for lr in rates[method]]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            runs = dict(zip(grid, pool.map(tune_at, grid)))
        validation = {method: {lr: runs[method, lr][0]["eval/valid_seen/all"]
                               for lr in rates[method]} for method in METHODS}
        chosen = {method: best_rate(scores) for method, scores in validation.items()}
        masks = inspect_simoe(work / f"simoe_lr{chosen['simoe']:g}", data["eval_seen"],
                              data["eval_unseen"])
        rows = table_rows({method: runs[method, chosen[method]] for method in METHODS})
    for method in METHODS:
        rows[method]["lr"] = chosen[method]
        rows[method]["validation"] = {f"{lr:g}": score
                                      for lr, score in validation[method].items()}
    return {"rows": rows, "masks": masks, "seed_seconds": seed_seconds}


def _simoe_model(config, vocab_size: int):
    """The SIMoE model of `config`, built on this CPU process (Megatron set up once)."""
    from megatron.core import parallel_state

    from megamoe.instruct.finetune import SIMoEFinetuning
    from megamoe.megatron.runtime import setup_megatron
    from megamoe.train.model import transformer_config

    if not parallel_state.model_parallel_is_initialized():
        setup_megatron(seed=config.training.seed)
    (model,) = SIMoEFinetuning().build_model(config, transformer_config(config, False, False),
                                             vocab_size)
    return model


def simoe_delta_parameters() -> int:
    """Entries of SIMoE's shared delta (one per weight of every interpolated linear and norm)."""
    from megamoe.train.config import load_config

    model = _simoe_model(load_config(str(INSTRUCT_CONFIG), []), vocab_size=128)
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith("delta_weight"))


def _load_simoe(run_dir: Path):
    """The trained SIMoE model of a run (weights verified, allow-listed), on this CPU process."""
    from megamoe.train.checkpoint import load_model_weights
    from megamoe.train.config import load_config
    from megamoe.train.inputs import data_sources

    config = load_config(str(run_dir / "config.yaml"), [])
    tokenizer = data_sources(config)[1]
    model = _simoe_model(config, tokenizer.vocab_size)
    load_model_weights(run_dir / "checkpoints", model, config)
    return model.eval(), tokenizer, config


def _module_kind(name: str) -> tuple[str, str]:
    """(layer, module type) of an interpolated module's name."""
    match = re.search(r"layers\.(\d+)\.", name)
    return (match.group(1) if match else "final"), name.rsplit(".", 1)[-1]


def inspect_simoe(run_dir: Path, *eval_files: Path) -> dict:
    """SIMoE's learned masks as served (density per layer and module, per expert, pairwise
    overlap; the expected L0 density beside them) and its router's mean coefficients per task
    family of the evaluation files."""
    import torch

    from megamoe.instruct.dataset import read_records
    from megamoe.simoe.penalties import (expected_density, interpolated_modules, mask_overlap,
                                         served_density, total_gated_parameters)

    model, tokenizer, config = _load_simoe(run_dir)
    modules = dict((n, m) for n, m in model.named_modules() if m in interpolated_modules(model))
    density = {}
    with torch.no_grad():
        for name, module in modules.items():
            layer, kind = _module_kind(name)
            density.setdefault(kind, {})[layer] = float(
                module.gated.served_nonzero(module.mask_logits).mean())
        total = total_gated_parameters(list(modules.values()))
        per_expert = served_density(list(modules.values()), total)
        expected = expected_density(list(modules.values()), total)
        overlap = mask_overlap(list(modules.values()), total, served=True)
        coefficients: dict[str, list] = {}
        for path in eval_files:
            for record in read_records(path):
                tokens = torch.tensor([tokenizer.tokenize(record.prompt)])
                a = model.route(tokens, torch.ones_like(tokens, dtype=torch.bool))[0]
                coefficients.setdefault(record.task, []).append(a)
    return {"density_by_module": density, "density_per_expert": per_expert.tolist(),
            "expected_density_per_expert": expected.tolist(), "overlap": overlap.tolist(),
            "coefficients": {task: torch.stack(v).mean(0).tolist()
                             for task, v in sorted(coefficients.items())},
            "target_density": 1.0 - config.finetune.simoe.get("target_sparsity", 0.75)}


def lora_rank_for(parameters: int) -> int:
    """The LoRA rank whose factors on the seed model's linears hold about `parameters`."""
    from megamoe.instruct.lora import rank_matching
    from megamoe.train.config import load_config
    from megamoe.train.model import build_model, transformer_config

    config = load_config(str(SEED_CONFIG), [])
    (dense,) = build_model(config, transformer_config(config, False, False), vocab_size=128)
    return rank_matching(dense, parameters)


def _moe_expert_parameters(config_path: Path) -> int:
    """Routed-expert weights of the upcycled model (every layer MoE, SwiGLU experts)."""
    from megamoe.train.config import load_config

    config = load_config(str(config_path), [])
    glu = 3 if config.model.swiglu else 2
    return config.model.num_layers * MOE["experts"] * glu * config.model.hidden_size * 384


def _pairwise_mean(matrix: list[list[float]]) -> float:
    m = len(matrix)
    return sum(matrix[i][j] for i in range(m) for j in range(m) if i != j) / max(m * (m - 1), 1)


def _total_variation(vectors: list[list[float]]) -> float:
    """Mean total-variation distance between the coefficient vectors of pairs of families."""
    pairs = [(a, b) for i, a in enumerate(vectors) for b in vectors[i + 1:]]
    return sum(0.5 * sum(abs(x - y) for x, y in zip(a, b)) for a, b in pairs) / max(len(pairs), 1)


def table_rows(arms: dict) -> dict:
    """Per method: exact match (seen, unseen, per family), parameters and wall seconds."""
    rows = {}
    for name, (last, stdout, seconds) in arms.items():
        trainable, total = parameter_counts(stdout)
        rows[name] = {"seen": last["eval/eval_seen/all"], "unseen": last["eval/eval_unseen/all"],
                      "trainable": trainable, "stored": total, "seconds": round(seconds),
                      "per_family": {k.split("/", 2)[2]: v for k, v in last.items()
                                     if k.startswith(("eval/eval_seen/", "eval/eval_unseen/"))
                                     and not k.endswith("/all")}}
    for name in ("full", "lora", "simoe"):  # served as one dense model per sequence
        rows[name]["active"] = rows["full"]["stored"]
    experts = _moe_expert_parameters(INSTRUCT_CONFIG)
    moe = rows["sparse_upcycling"]
    moe["active"] = moe["stored"] - experts + experts * MOE["topk"] // MOE["experts"]
    return rows


def standard_error(per_seed: list[float], examples: int) -> float:
    """Binomial standard error of the mean over seeds of exact-match rates, each measured on
    `examples` examples."""
    return math.sqrt(sum(p * (1 - p) / examples for p in per_seed)) / len(per_seed)


def summarise(replicates: list[dict], quick: bool, steps: int, per_family_eval: int) -> dict:
    """The mean over seeds of each method's exact match (each seed's beside it) and of each
    mask statistic; the claims are judged on the means (the exact-match ones show their
    binomial standard errors, `per_family_eval` examples of each family per seed)."""
    from megamoe.instruct import tasks

    first = replicates[0]
    rows = {name: {**row, **{key: fmean([r["rows"][name][key] for r in replicates])
                            for key in ("seen", "unseen", "seconds")},
                   "seen_per_seed": [r["rows"][name]["seen"] for r in replicates],
                   "unseen_per_seed": [r["rows"][name]["unseen"] for r in replicates]}
            for name, row in first["rows"].items()}
    masks = [r["masks"] for r in replicates]
    mean_density = fmean([fmean(m["density_per_expert"]) for m in masks])
    expected_density = fmean([fmean(m["expected_density_per_expert"]) for m in masks])
    overlap = fmean([_pairwise_mean(m["overlap"]) for m in masks])
    independent = fmean([_pairwise_mean([[a * b for b in m["density_per_expert"]]
                                         for a in m["density_per_expert"]]) for m in masks])
    spread = fmean([_total_variation(list(m["coefficients"].values())) for m in masks])
    target = first["masks"]["target_density"]
    simoe, full, lora, moe = (rows[k] for k in ("simoe", "full", "lora", "sparse_upcycling"))
    examples = {"seen": per_family_eval * len(tasks.SEEN_FAMILIES),
                "unseen": per_family_eval * len(tasks.UNSEEN_FAMILIES)}

    def match(row: dict, split: str) -> str:
        error = standard_error(row[f"{split}_per_seed"], examples[split])
        return f"{row[split]:.3f} +- {error:.3f}"

    claims = [
        ("SIMoE generalises to unseen task families at least as well as full fine-tuning",
         simoe["unseen"] >= full["unseen"],
         f"unseen exact match {match(simoe, 'unseen')} vs {match(full, 'unseen')}; "
         f"+- the binomial standard error, {examples['unseen']} examples per seed"),
        ("SIMoE beats LoRA with as many trainable parameters on the seen task families",
         simoe["seen"] > lora["seen"],
         f"seen exact match {match(simoe, 'seen')} vs {match(lora, 'seen')}; "
         f"+- the binomial standard error, {examples['seen']} examples per seed"),
        ("SIMoE's masks reach the target sparsity (density within 0.02 of the target)",
         abs(mean_density - target) <= 0.02,
         f"mean served density {mean_density:.3f} (expected L0 {expected_density:.3f}), "
         f"target {target:.3f}"),
        ("different task families get different merging coefficients",
         spread >= 0.05, f"mean pairwise total-variation distance {spread:.3f} (bar 0.05)"),
        ("the experts' masks overlap less than independent masks of their density",
         overlap < independent,
         f"mean pairwise overlap {overlap:.4f} vs {independent:.4f} if independent"),
        ("SIMoE serves with fewer parameters than the 4-expert top-2 upcycled MoE",
         simoe["active"] < moe["active"],
         f"{simoe['active']:,} vs {moe['active']:,} active "
         f"({1 - simoe['active'] / moe['active']:.0%} fewer; paper: about 30%)"),
    ]
    return {"quick": quick, "seeds": len(replicates), "tune_steps": steps,
            "seed_seconds": round(fmean([r["seed_seconds"] for r in replicates])),
            "rows": rows, "masks": first["masks"],
            "masks_per_seed": masks,
            "claims": [{"claim": c, "held": bool(h), "evidence": e} for c, h, e in claims]}


def markdown(result: dict) -> str:
    lines = ["# SIMoE study (tools/study_simoe.py)", "",
             f"{result['seeds']} seed(s), each with its own task set, dense seed model "
             f"(pretrained in {result['seed_seconds']} s on the default corpus and, half of its "
             "tokens, every family's facts stated as prose, unseen ones included) and tuning "
             "order; every method tunes "
             f"{result['tune_steps']} steps, {result['jobs']} run(s) at a time. LoRA rank "
             f"{result['lora_rank']} matches SIMoE's delta. Each method tunes at the learning "
             f"rate of {', '.join(f'{lr:g}' for lr in result['learning_rates'])} that scored best "
             "on the first seed's validation split (new examples of the seen families; the "
             "scores under the table); the later seeds use it, and SIMoE's masks keep their "
             f"own rate ({result['mask_lr']:g}, SMAT's separate optimizer) at every rate. "
             "Exact match on held-out examples of the seen task families and on the unseen "
             "families: the mean over seeds, each seed's in brackets; the masks' figures are "
             "those served."
             + (" QUICK MODE: pipeline check only." if result["quick"] else ""),
             "", "| method | lr | seen | unseen | trainable | active at inference | stored | "
             "wall s |", "|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, key: str) -> str:
        seeds = ", ".join(f"{v:.3f}" for v in r[f"{key}_per_seed"])
        return f"{r[key]:.3f} ({seeds})"

    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r['lr']:g} | {cell(r, 'seen')} | {cell(r, 'unseen')} | "
                     f"{r['trainable']:,} | {r['active']:,} | {r['stored']:,} | "
                     f"{round(r['seconds'])} |")
    lines += ["", "Validation exact match by learning rate (first seed): " + "; ".join(
        f"{name} " + ", ".join(f"{lr} -> {score:.3f}" for lr, score in r["validation"].items())
        for name, r in result["rows"].items()) + ".", "", "## Claims", ""]
    lines += [f"- {'HELD' if c['held'] else 'NOT HELD'}: {c['claim']} ({c['evidence']})"
              for c in result["claims"]]
    lines += ["", "![mask density](mask_density.png)", "![mask overlap](mask_overlap.png)",
              "![router coefficients](router_coefficients.png)", ""]
    return "\n".join(lines)


def plots(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    masks = result["masks"]
    kinds = sorted(masks["density_by_module"])
    layers = sorted({layer for d in masks["density_by_module"].values() for layer in d},
                    key=lambda x: (x == "final", x))
    grid = [[masks["density_by_module"][k].get(layer, float("nan")) for layer in layers]
            for k in kinds]
    panels = [("mask_density.png", grid, layers, kinds, "served mask density (layer x module)"),
              ("mask_overlap.png", masks["overlap"], range(len(masks["overlap"])),
               range(len(masks["overlap"])), "shared fraction of the delta (expert x expert)"),
              ("router_coefficients.png", list(masks["coefficients"].values()),
               range(len(next(iter(masks["coefficients"].values())))),
               list(masks["coefficients"]), "mean merging coefficient (family x expert)")]
    for filename, values, xs, ys, title in panels:
        fig, ax = plt.subplots(figsize=(6, 0.35 * len(list(ys)) + 1.5))
        image = ax.imshow(values, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(list(xs))), [str(x) for x in xs])
        ax.set_yticks(range(len(list(ys))), [str(y) for y in ys])
        ax.set_title(title)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        partial = out / f".{filename}.partial"
        fig.savefig(partial, format="png", dpi=80)
        plt.close(fig)
        os.replace(partial, out / filename)


def write(result: dict, out: Path) -> None:
    """study.json, study.md and the plots, written in a folder beside `out` that then replaces
    it (only if `out` is empty or the study's: megamoe.ownership.replace_folder)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plots(result, work)
        (work / "study.json").write_text(json.dumps(result, indent=1))
        (work / "study.md").write_text(markdown(result))
        work.chmod(0o755)
        replace_folder(work, out, TOOL, "--out")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _rates(text: str) -> tuple[float, ...]:
    """--learning-rates as numbers; () unless every comma-separated part is a positive number."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        return ()
    return rates if all(rate > 0 for rate in rates) else ()


def main(argv=None) -> int:
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "study_simoe"),
                        help="result folder (default runs/study_simoe; the published study: "
                             "docs/study_simoe)")
    parser.add_argument("--quick", action="store_true", help="a few steps per run (CI)")
    parser.add_argument("--jobs", type=int_at_least(1), default=1,
                        help="tuning runs trained at a time (each gets cores / jobs threads)")
    parser.add_argument("--learning-rates", default="",
                        help="comma-separated grid each method chooses its learning rate from "
                             "on the first seed's validation split (default 1e-3,3e-3,1e-2, "
                             "the config's rate and factors of 3 above it; quick: 1e-3)")
    parser.add_argument("--cache-dir", help="data.cache_dir of every run (the default corpus)")
    parser.add_argument("--runs", help="train here (one folder per seed, kept afterwards); a "
                                       "rerun reuses every run that finished with the same "
                                       "command")
    args = parser.parse_args(argv)
    rates = _rates(args.learning_rates) if args.learning_rates else ()
    if args.learning_rates and not rates:
        raise ConfigError(f"--learning-rates {args.learning_rates!r} must be positive numbers "
                          "separated by commas, e.g. 1e-3,3e-3")
    if args.cache_dir:
        CACHE.append(f"data.cache_dir={args.cache_dir}")
    if args.jobs > 1:
        RUN_ENV["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    check_outputs(args.out, args.runs, (QUICK if args.quick else FULL)["seeds"], args.cache_dir)
    runs = Path(args.runs).resolve() if args.runs else None
    end_children_on_sigterm()
    result = study(args.quick, args.jobs, rates, runs)
    write(result, Path(args.out))
    for claim in result["claims"]:
        print(f"{'HELD' if claim['held'] else 'NOT HELD'}: {claim['claim']} ({claim['evidence']})")
    print(f"wrote {Path(args.out) / 'study.md'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
