"""Every bench runs its whole report on a tiny setting (``--quick``) as a process and exits 0:
each line the report prints normally (its headers, a row per mode, model, policy or attack; of
hostile_peers' attacks the control and one, test_hostile_peers.py runs all five) is there. What the figures say is for the benches to show, not checked here; that the report runs
is, so that a change elsewhere (a new field, a moved helper) cannot break a bench unnoticed.
concurrent_decode, families and weights_fetch have tests of their own (test_bench_*.py);
tests/unit/test_bench_coverage.py fails on a bench that no test runs."""

import re

import pytest

from shardnet.testing import natlab
from shardnet.testing.helpers import bench_stdout


NUM = r"-?[\d.]+"
SIM_POLICIES = ("shardnet-before", "shardnet", "least-served", "water-filling")

#: bench script (under bench/) -> its arguments and a pattern per line its report must print
ONE_PROCESS = {
    "batched_block.py": (["--quick"], [
        r"^context +N +one at a time +batched +speedup +batched tok/s$",
        *(rf"^{c} +{n} +{NUM} +{NUM} +{NUM}x +{NUM}$" for c in (8, 40) for n in (1, 4)),
        *(rf"^fit: context {c}: c\(b\) = {NUM} ms \+ b \* {NUM} ms$" for c in (8, 40))]),
    "cancel_torture.py": (["--quick"], [
        r"^path +writes +cut +\(deadline/nursery/reset\)",
        *(rf"^{path} +20 +\d+ +\( *\d+/\d+/\d+\) +\d+ +\d+ +\d+ +{NUM} +(yes|NO) +{NUM}$"
          for path in ("direct", "relayed"))]),
    "logit_tolerance.py": (["--sessions", "2", "--tokens", "3", "--seeds", "1"], [
        r"^tiny-llama, 2 sessions batched x 3 tokens x 1 seeds, cpu$",
        r"^dtype +max rel logit diff +max rel gap +argmax flips +max audit div$",
        *(rf"^{d} +{NUM}e[-+]\d+ +" for d in ("float32", "float16", "bfloat16"))]),
    "draft_agreement.py": (["--quick"], [
        rf"tiny-llama-draft: greedy agreement with the target {NUM}% over 16 positions$",
        rf"^n-gram drafter: proposes at \d+ positions, right at {NUM}% of them$",
        r"^over 2 prompts \(code\) x 8 target tokens, teacher-forced",
        *(rf"^  {shape} *: {NUM} tokens per traversal \({NUM} drafts, {NUM} ms drafting\)$"
          for shape in ("suffix chain of  8", "suffix tree of  8", "suffix tree of 16", "suffix tree of 32",
                        "draft  chain of  6", "draft  chain of 12", r"draft  tree of 6 \+  6",
                        r"draft  tree of 8 \+  8")),
        r"^  suffix chain of 8 drafting from a gateway's shared outputs too \(serve --share-outputs\):$",
        *(rf"^    {who}: {NUM} tokens per traversal$"
          for who in ("the other prompts' answers", "an earlier answer to the same prompt"))]),
    "quantization.py": (["--quick"], [
        r"^dtype bfloat16, 2 prompts x 3 tokens, 1 CPU threads",
        r"^\| model \| quantize \| bytes/layer \|",
        *(rf"^\| {re.escape(model)} \| {mode} \| {NUM} MiB \| {NUM} \|"
          for model in ("tiny-llama (shipped, 8 layers, hidden 224)", "random llama (2 layers, hidden 128)",
                        "random mixtral (2 layers, hidden 64, 8 experts)")
          for mode in ("none", "int8", "int4", "none, float32"))]),
    "stream_echo.py": (["--quick"], [
        rf": {NUM} MiB/s \(best of 2\), median 64-byte round trip {NUM} ms$"]),
    "wire_compression.py": (["--quick"], [
        r"^wire dtype +bytes/token/hop +vs float32 +greedy tokens agreeing$",
        *(rf"^{w} +\d+ +{NUM} +\d+/12$" for w in ("float32", "float16", "bfloat16", "int8q"))]),
    "swarm_sim/run.py": (["--quick", "--jobs", "1"], [
        r"^model +policy +peers +covered",
        *(rf"^{model} +{policy} +\d+ +{NUM}% " for model in ("llama-70b", "deepseek-v3") for policy in SIM_POLICIES),
        r"^\(llama-70b: offered ", r"^\(deepseek-v3: offered "]),
}

#: benches that start processes of their own (peers, a server, attackers)
MULTI_PROCESS = {
    "overlay_stream.py": (["--quick"], [
        r"^ +raw TCP +overlay +ratio$", rf"^throughput \(MB/s\) +{NUM} +{NUM} +{NUM}",
        rf"^median RTT \(ms\) +{NUM} +{NUM} +{NUM}", rf"^connect \(ms\) +{NUM} +{NUM} +{NUM}",
        rf"^connect, py-libp2p default ConnectionConfig \(ms\) +{NUM}",
        rf"^overlay stream over a 10 ms RTT path \(ping {NUM} ms\): {NUM} MB/s"]),
    "wan_decode.py": (["--quick"], [
        r"^WAN edge: 5 ms one way", r"^tiny-llama \(float32\) over 2 peers \[\(0, 4\), \(4, 8\)\]",
        r"^mode +tok/s +x plain +tok/trav +accepted +stale +ceiling +reached$",
        *(rf"^{re.escape(mode)} +{NUM} +{NUM}x +{NUM} +(-|\d+%) +\d+% +{NUM} +\d+%$"
          for mode in ("plain decode", "speculative, draft model, k=2", "speculative, draft tree, k=2+2",
                       "speculative, draft tree, shape chosen (k<=12)", "speculative, n-gram, k=2",
                       "speculative, suffix, k=2", "speculative, auto, k=2 (trees: shape chosen)",
                       "speculative, auto model-free, k=2",
                       "pipelined, draft model, k=2, depth 2",
                       "pipelined, n-gram, k=2, depth 2", "pipelined, suffix, k=2, depth 2")),
        r"^greedy output identical in every mode and run: True$",
        rf"^speculative, draft tree, k=2\+2: \d+ trees, alpha {NUM}, beta {NUM}: the tree law predicts {NUM} tokens",
        rf"^speculative, draft tree, shape chosen \(k<=12\): \d+ trees, alpha {NUM}, beta {NUM}: shapes chosen per "
        rf"tree, {NUM} drafts per traversal on average, most often \d+\+\d+ \(\d+x\)",
        rf"^  its shaper's estimates after each run, medians: trip {NUM} ms \+ {NUM} ms a position \(the client's "
        rf"own work on a step included\), drafting {NUM} ms a token, alpha {NUM}, beta {NUM}$",
        r"^delays above plus compute measured in this process per chunk: 1 position "]),
    "pipeline_decode.py": (["--quick"], [
        r"^model tiny-llama: 8 layers over 2 peers", rf"^decode \(tok/s\) +{NUM} +{NUM} +{NUM}",
        rf"^time per token \(ms\) +{NUM} +{NUM}$", rf"^per-hop overhead: {NUM} ms over 3 network hops",
        rf"^speculative through the chain \(draft tiny-llama-draft, k=4\): {NUM} tok/s",
        r"^greedy tokens identical to transformers \(plain and speculative\): True$",
        r"^CPU per token over the plain chain runs \(7 tokens after each run's first\), ms$", r"^process +CPU +compute +overhead$",
        *(rf"^{who} +{NUM} +{NUM} +{NUM}$" for who in ("peer 1", "peer 2", "client"))]),
    "honest_compute.py": (["--quick"], [
        r"^8 tokens per request, 1 rounds, medians:$",
        *(rf"^  {re.escape(mode)} +{NUM} tok/s +\({NUM}x of off\)" for mode in ("off", "receipts")),
        rf"^  receipts\+checks@1 +{NUM} tok/s +\({NUM}x of off\); \d+ steps re-run on a witness, \d+ agreed$",
        rf"^  collecting a run receipt after a request: {NUM} ms$"]),
    "swarm_routing.py": (["--quick"], [
        rf"^routing: chosen chain\(s\) \[.+\]: {NUM} tok/s; slow chain .+: {NUM} tok/s; ratio {NUM}x$",
        r"^  heal 1: \S+ \[\(\d, \d\)\] failed during \w+; healed in \d+ ms",
        rf"^healing: median heal \d+ ms; a request with one failure takes [+-]{NUM} s"]),
    "plan_routes.py": (["--quick"], [
        r"^plan_route over synthetic swarms of 24 layers \(median of 1\): whole spans against sub-spans$",
        *(rf"^200 +{kind} +{NUM} ms +({NUM} ms, \d+ hops|no route) +{NUM} ms +({NUM} ms, \d+ hops|no route) "
          rf"+{NUM}x$" for kind in ("aligned", "random"))]),
    "gateway_load.py": (["--quick"], [
        rf"^this: 2 users x 2 s: requests=\d+ failures=\d+ \({NUM} %\) p50={NUM} s"]),
    "prefix_chat.py": (["--quick"], [  # the texts must not change with prefix reuse
        r"^conversation +reuse +prompt 1 +TTFT 1 s +prompt 2 +TTFT 2 s +2 / 1 +target$",
        rf"^system prompt +off +\d+ +{NUM} +\d+ +{NUM} +{NUM}x +-$",
        rf"^system prompt +private +\d+ +{NUM} +\d+ +{NUM} +{NUM}x +(meets|misses)$",
        r"^system prompt: turn-2 TTFT with reuse [\d.]+x of without; turn-1 texts same with and without "
        r"reuse: True; turn-2 texts same: True$"]),
    "hostile_peers.py": (["--quick"], [
        r"^16 tokens per generation, medians of 1 generations before and during each attack:$",
        r"^attack +before s +during s +ratio +tokens +new peer +victim RSS \+MiB +attacker's requests$",
        *(rf"^{attack} +{NUM} +{NUM} +{NUM} +(same|CHANGED) +(ok|REFUSED) +{NUM}  "
          for attack in ("spin", "garbage"))]),  # test_hostile_peers.py runs all five
    "nat_traversal.py": (["--quick"], [
        r"^first direct connection: process ready ", r"^echo throughput \(1 MiB out and back, median of 1\): ",
        *(rf"^{pair} +\d+/\d+ punches, \d+/\d+ attempts succeeded"
          for pair in ("cone -> cone", "symmetric -> cone", "cone -> symmetric", "symmetric -> symmetric")),
        r'^ "punch": \{']),
}


def run_bench(script: str, args: list[str], patterns: list[str], timeout: float) -> None:
    module = "bench." + script.removesuffix(".py").replace("/", ".")  # run as python -m bench.NAME
    out = bench_stdout(module, *args, timeout=timeout)
    missing = [p for p in patterns if not re.search(p, out, re.MULTILINE)]
    assert not missing, f"{script}: no line matches {missing} in:\n{out}"


@pytest.mark.parametrize("script", ONE_PROCESS)
def test_a_bench_runs_its_report(script):
    run_bench(script, *ONE_PROCESS[script], timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("script", MULTI_PROCESS)
def test_a_multi_process_bench_runs_its_report(script):
    if script == "nat_traversal.py" and natlab.available() is not None:
        pytest.skip(f"NAT lab: {natlab.available()}")
    run_bench(script, *MULTI_PROCESS[script], timeout=300)
