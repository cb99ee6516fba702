"""jobs/netns-cluster.sh: an emulated cluster of 2 nodes (network namespaces, tbf-shaped links), and hpcpipe on it.

Across the 2 nodes, every message between them goes over TCP (UCX), not shared memory, each node has its
own host name, /tmp and /dev/shm: the default training run, a tp=2 x pp=2 llama step and a pp=2 serve
request give what one host gives; a rank killed on one node ends the job within 30 s with nothing left on
either node and --resume (across the nodes) ends where an uninterrupted run does; a node-local
checkpoint.dir is refused before step 0. The script refuses clearly and `down` removes what `up` made.
Needs root (CI runs it as root); skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from support import netns
from support.configs import merged, sets
from support.launch import command, one_error, pids_alive, run
from support.serve import make_weights
from support.state import assert_nested_equal, checkpoint_cli, checkpoint_state, metrics_losses

from hpcpipe.state import directory_protocol as cf

pytestmark = pytest.mark.netns

LLAMA = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 16, "n_heads": 4, "n_kv_heads": 2,
         "n_blocks": 2, "d_ff": 12, "dtype": "float64", "seed": 7}


@pytest.fixture(scope="module")
def cluster():
    """2 nodes joined through 10 Gbit/s links, removed at the end whatever happened."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    made = netns.Cluster(2, "10gbit")
    try:
        yield made
    finally:
        made.down()


def _host(tmp: Path, n: int, module: str, args: list[str], timeout: float = 180):
    """The same command on this host alone (the reference)."""
    return run(command(n, module, args), timeout=timeout, cwd=tmp, env={"PYTHONUNBUFFERED": "1"})


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_refusals_are_one_line_with_status_2():
    for args, words in ((["up", "0", "1gbit"], "node count"), (["up", "2", "fast"], "RATE"),
                        (["up", "2"], "usage"), (["sideways"], "usage")):
        proc = netns.script(*args)
        assert proc.returncode == 2 and words in proc.stderr and "line " not in proc.stderr, (args, proc.stderr)
    bad_name = netns.script("up", "2", "1gbit", env={"HPCPIPE_NETNS_NAME": "Has-Dash"})
    assert bad_name.returncode == 2 and "HPCPIPE_NETNS_NAME" in bad_name.stderr
    nothing = netns.script("args")
    assert nothing.returncode == 2 and "no cluster is up" in nothing.stderr
    down = netns.script("down")
    assert down.returncode == 0 and "nothing is up" in down.stdout
    if os.geteuid() != 0:
        proc = netns.script("up", "2", "1gbit")
        assert proc.returncode == 2 and "needs root" in proc.stderr
        return
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: the refusals of a non-root user are not tested")
    argv = ["bash", str(netns.SCRIPT), "up", "2", "1gbit"]
    env = dict(os.environ, **netns.ENV)
    user = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *argv], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert user.returncode == 2 and "needs root" in user.stderr, user.stderr
    # root without CAP_SYS_ADMIN (a container): no namespace can be made
    capless = subprocess.run([setpriv, "--bounding-set=-sys_admin", *argv], env=env, capture_output=True,
                             text=True, timeout=60, check=False)
    assert capless.returncode == 2 and "network namespaces are unavailable" in capless.stderr, capless.stderr
    assert not Path(netns.ENV["HPCPIPE_NETNS_DIR"]).exists()


def _ours(name: str) -> dict[str, list[str]]:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {"links": [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if f" {name}-" in line],
            "netns": [line.split()[0] for line in spaces.splitlines() if line.startswith(f"{name}-")],
            "files": [p for p in (f"/run/{name}-netns",) if os.path.exists(p)]}


def test_up_makes_shaped_nodes_and_down_removes_exactly_that():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    env = {"HPCPIPE_NETNS_NAME": "hpcupdn", "HPCPIPE_NETNS_NET": "10.213.10", "HPCPIPE_NETNS_DIR": "/run/hpcupdn-netns"}
    had_run_netns = os.path.exists("/run/netns")
    up = netns.script("up", "3", "1gbit", env=env)
    try:
        assert up.returncode == 0, up.stderr
        made = _ours("hpcupdn")
        assert sorted(made["netns"]) == ["hpcupdn-node0", "hpcupdn-node1", "hpcupdn-node2"], made
        assert sorted(made["links"]) == ["hpcupdn-br", "hpcupdn-v0", "hpcupdn-v1", "hpcupdn-v2"], made
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "hpcupdn-v1"], capture_output=True, text=True).stdout
        inside = subprocess.run(["ip", "netns", "exec", "hpcupdn-node1", "tc", "qdisc", "show", "dev", "eth0"],
                                capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc and "tbf" in inside and "1Gbit" in inside, (qdisc, inside)
        assert Path("/run/hpcupdn-netns/hosts").read_text().split() == ["10.213.10.1", "10.213.10.2", "10.213.10.3"]
        again = netns.script("up", "2", "1gbit", env=env)
        assert again.returncode == 2 and "already up" in again.stderr
    finally:
        down = netns.script("down", env=env)
    assert down.returncode == 0, down.stderr
    assert _ours("hpcupdn") == {"links": [], "netns": [], "files": []}
    assert os.path.exists("/run/netns") == had_run_netns


def test_default_training_run_across_2_nodes_equals_one_host(cluster, tmp_path):
    # the embedded default job (dp=2 x pp=4, 100 steps) with metrics; ranks alternate between the nodes
    args = sets(log={"metrics": "m.jsonl", "progress": False})
    host = _host(tmp_path, 8, "hpcpipe.train", args)
    _ok(host)
    work = cluster.workdir("default")
    before = cluster.link_tx_bytes()
    across = cluster.run(cluster.command(8, "hpcpipe.train", args), cwd=work)
    _ok(across)
    sent = {node: n - before[node] for node, n in cluster.link_tx_bytes().items()}
    assert metrics_losses(work / "m.jsonl") == metrics_losses(tmp_path / "m.jsonl")
    records = [json.loads(line) for line in open(work / "m.jsonl")]
    mine = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert all("link_bytes" not in r for r in mine)      # one host: nothing leaves a node
    assert [r["sent_bytes"] for r in records] == [r["sent_bytes"] for r in mine]
    for node in cluster.nodes:
        counted = sum(r["link_bytes"][node] for r in records)
        # the kernel's count of the link also holds TCP/IP headers, MPI's own traffic and the checkpoint's gathers
        assert 0 < counted <= sent[node], (node, counted, sent)
    assert checkpoint_cli("verify", work / "checkpoints").returncode == 0
    assert cluster.pids() == {}


def test_tp2_pp2_llama_step_across_2_nodes_equals_one_host(cluster, tmp_path):
    # round robin: each stage's two tp ranks are on different nodes, so every tp sum crosses the link
    sections = {"parallel": {"dp": 1, "pp": 2, "tp": 2}, "model": LLAMA, "data": {"synthetic_samples": 16},
                "train": {"micro_batches": 2, "micro_batch_size": 2, "steps": 2, "optimizer": "adam", "lr": 0.01},
                "checkpoint": {"dir": ""}, "log": {"metrics": "m.jsonl", "progress": False}}
    host = _host(tmp_path, 4, "hpcpipe.train", sets(**sections))
    _ok(host)
    work = cluster.workdir("llama")
    across = cluster.run(cluster.command(4, "hpcpipe.train", sets(**sections)), cwd=work)
    _ok(across)
    want, got = metrics_losses(tmp_path / "m.jsonl"), metrics_losses(work / "m.jsonl")
    assert sorted(got) == [0, 1] and all(abs(got[s] - want[s]) <= 1e-12 * abs(want[s]) for s in want), (got, want)
    assert all(r["link_bytes"][n] > 0 for line in open(work / "m.jsonl")
               for r in [json.loads(line)] for n in cluster.nodes)


def _completion(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


URL = re.compile(r"on http://[\d.]+:(\d+)/v1")


def _serve(argv: list[str], cwd: Path, log: Path, url_host: str) -> tuple[str, str]:
    """Start serve, send one request, stop it with SIGTERM; return (the completion's text, the log)."""
    with open(log, "w") as out:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TMPDIR", None)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            deadline = time.time() + 120
            while not URL.search(log.read_text()) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.1)
            found = URL.search(log.read_text())
            assert proc.poll() is None and found, log.read_text()
            answer = _completion(f"http://{url_host}:{found.group(1)}", "hello wor")
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return answer["choices"][0]["text"], log.read_text()


def test_pp2_serve_request_across_2_nodes_equals_one_host(cluster, tmp_path):
    work = cluster.workdir("serve")
    weights = work / "gpt.h5"
    make_weights(weights)
    args = ["--weights", str(weights), "--port", "0", "--set", "parallel.pp=2"]
    want, _ = _serve(command(2, "hpcpipe.serve", args), tmp_path, tmp_path / "host.log", "127.0.0.1")
    # the front end runs on world rank 0 in node 0, listening on that node's address
    node0 = cluster.addresses[0]
    got, log = _serve(cluster.command(2, "hpcpipe.serve", [*args, "--host", node0]), work, work / "serve.log", node0)
    assert got == want and len(want) > 0, (got, want, log)
    assert cluster.pids() == {}


STEPS = 12
TINY = {"model": {"dims": [8, 8, 8, 8, 8]}, "data": {"synthetic_samples": 40, "shuffle": True},
        "train": {"steps": STEPS, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam", "lr": 0.01},
        "checkpoint": {"every": 2, "keep": 2}, "log": {"progress": False}}


def _latest_step(ck_dir: Path) -> int | None:
    name = cf.read_latest(ck_dir)
    return None if name is None else int(name.rsplit("step-", 1)[1])


def test_rank_killed_on_one_node_ends_the_job_and_resume_across_nodes_equals_uninterrupted(cluster, tmp_path):
    args = sets(**merged(TINY, {"log": {"metrics": "m.jsonl"}, "checkpoint": {"dir": "ck"}}))
    ref = run(command(8, "hpcpipe.train", args), cwd=tmp_path)
    _ok(ref)
    work = cluster.workdir("kill")
    (work / "pids").mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", HPCPIPE_PID_DIR=str(work / "pids"), HPCPIPE_STEP_SLEEP="0.3")
    env.pop("TMPDIR", None)
    proc = subprocess.Popen(cluster.command(8, "hpcpipe.train", args), env=env, cwd=work, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while (_latest_step(work / "ck") or 0) < 4 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        victim = int((work / "pids" / "rank-5.pid").read_text())     # round robin: rank 5 is on node 1
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    while (cluster.pids() or pids_alive(work / "pids")) and time.time() - killed_at < 30:
        time.sleep(0.1)
    assert cluster.pids() == {} and pids_alive(work / "pids") == [], "left behind on a node after the kill"
    crashed_at = _latest_step(work / "ck")
    assert crashed_at is not None and 4 <= crashed_at < STEPS

    resumed = cluster.run(cluster.command(8, "hpcpipe.train", args + ["--resume"]), cwd=work)
    _ok(resumed)
    assert f"resumed at step {crashed_at}" in resumed.stdout
    assert metrics_losses(work / "m.jsonl") == metrics_losses(tmp_path / "m.jsonl")
    params, opt = checkpoint_state(work / "ck")
    ref_params, ref_opt = checkpoint_state(tmp_path / "ck")
    assert_nested_equal(params, ref_params)
    assert_nested_equal(opt, ref_opt)


def test_a_node_local_checkpoint_dir_is_refused_before_step_0(cluster):
    proc = cluster.run(cluster.command(4, "hpcpipe.train", sets(train={"steps": 50}, parallel={"pp": 2},
                                                               checkpoint={"dir": "/tmp/ck"})))
    line = one_error(proc, "checkpoint.dir '/tmp/ck'", "not one directory shared by every node",
                     f"{netns.NAME}-node1")
    assert "step 1/" not in proc.stdout, line
    assert cluster.pids() == {}

