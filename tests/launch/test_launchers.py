"""Every launch path users already have, run as real subprocesses on CPU ranks: the shipped
scripts in launch/ (torchrun, two no-ssh nodes, two hosts in network namespaces) and
``accelerate launch`` with the shipped YAML. Each trains the model the plain process trains."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
import yaml
from conftest import (BIN, REPO, TIMEOUT_S, assert_same_model, deepspeed_cmd, free_port,
                      leaked_shm, run, summary, tiny_config)

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]


def test_torchrun_script(tmp_path, reference_run):
    path = tiny_config(tmp_path)
    port = free_port()
    run([str(REPO / "launch" / "torchrun.sh"), "2", str(path)],
        env={"MASTER_PORT": str(port)})
    result = summary(path)
    assert result["world_size"] == 2
    assert_same_model(result, reference_run)
    assert leaked_shm(port) == []


def test_accelerate_launch_with_shipped_yaml(tmp_path, reference_run):
    """launch/accelerate/single_node.yaml (use_cpu: true here: there is no GPU); its
    deepspeed_config_file (ZeRO-2) replaces the run config's ZeRO-0 JSON."""
    accel = yaml.safe_load((REPO / "launch" / "accelerate" / "single_node.yaml").read_text())
    assert accel["deepspeed_config"]["deepspeed_config_file"] == "ds_configs/zero2.json"
    accel["use_cpu"] = True
    accel_file = tmp_path / "accelerate.yaml"
    accel_file.write_text(yaml.safe_dump(accel))
    path = tiny_config(tmp_path)
    run([str(BIN / "accelerate"), "launch", "--config_file", str(accel_file), "--main_process_port",
         str(free_port()), str(BIN / "gmeta-ds"), "train", "--config", str(path)])
    result = summary(path)
    assert result["world_size"] == 2 and result["ds_config"]["zero_optimization"]["stage"] == 2
    assert_same_model(result, reference_run)


def _two_node_launch(tmp_path, hosts: list[tuple[list[str], dict, str]], *overrides: str) -> dict:
    """Start multinode_no_ssh.sh once per node (command prefix, extra env, master address;
    ``overrides``: its trailing ``--set key=value`` arguments); wait for both with a timeout;
    return the summary."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    path = tiny_config(tmp_path)
    port = str(free_port())
    procs = []
    for node_rank, (prefix, env, master) in enumerate(hosts):
        cmd = [*prefix, str(REPO / "launch" / "multinode_no_ssh.sh"), str(hostfile), str(node_rank),
               master, str(path), *overrides]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env={**os.environ, **env,
                                                      "MASTER_PORT": port}))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-5000:]
    assert "Hostfile" not in outputs[0]
    return summary(path)


def test_two_nodes_without_ssh(tmp_path, reference_run):
    result = _two_node_launch(tmp_path, [([], {}, "127.0.0.1"), ([], {}, "127.0.0.1")])
    assert result["world_size"] == 2
    assert_same_model(result, reference_run)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (10.231.x.1 and .2): two hosts with their
    own addresses. Always removed, also when the test fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    names, links = [f"gmeta_a_{tag}", f"gmeta_b_{tag}"], [f"gma{tag}", f"gmb{tag}"]
    subnet = f"10.231.{int(tag, 16) % 250 + 1}"
    try:
        for name in names:
            made = _ip("netns", "add", name)
            if made.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
        steps = [("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for i, (name, link) in enumerate(zip(names, links)):
            steps += [("link", "set", link, "netns", name),
                      ("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", link),
                      ("-n", name, "link", "set", link, "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield [(name, link, f"{subnet}.{i + 1}") for i, (name, link) in enumerate(zip(names, links))]
    finally:
        for name in names:
            _ip("netns", "del", name)
        assert not any(name in _ip("netns", "list").stdout for name in names)


def test_two_hosts_in_network_namespaces(tmp_path, reference_run, two_hosts):
    """Node 0 and node 1 only reach each other over the veth pair, by address."""
    master = two_hosts[0][2]
    hosts = [(["ip", "netns", "exec", name], {"GLOO_SOCKET_IFNAME": link}, master)
             for name, link, _ in two_hosts]
    result = _two_node_launch(tmp_path, hosts)
    assert result["world_size"] == 2
    assert_same_model(result, reference_run)


def test_two_sites_on_two_hosts_in_network_namespaces(tmp_path, two_hosts):
    """Issue 50 item 3: a site per host of a 2-host hostfile. The script's preflight (`gmeta-ds
    validate --hostfile`) used to refuse it (the run's 2 hosts applied to a site's single rank);
    now both sites train, each on its own host, and end with the same weights; metrics.jsonl
    says which task count is the run's and which the site's."""
    master = two_hosts[0][2]
    hosts = [(["ip", "netns", "exec", name], {"GLOO_SOCKET_IFNAME": link}, master)
             for name, link, _ in two_hosts]
    site0 = _two_node_launch(tmp_path, hosts, "--set", "sites.count=2", "--set", "sites.sync_every=2",
                             "--set", "embedding.sharding=sharded", "--set", "embedding.exchange_topology=auto")
    out = tmp_path / "run"
    site1 = json.loads((out / "sites" / "site-1" / "summary.json").read_text())
    assert site0["sites"]["count"] == 2 and site0["sites"]["ranks_per_site"] == 1
    assert site0["sites"]["synchronisations"] == 2 and site0["sites"]["cross_site_bytes_site"] > 0
    assert site0["dense_checksum"] == site1["dense_checksum"]  # the same weights after the last one
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["tasks"], last["site_tasks"]) == (32, 16)  # 4 meta-steps x 8 tasks, 4 of them per site
    assert last["tasks_per_s"] == pytest.approx(2 * last["site_tasks_per_s"])


def test_bad_hostfile_stops_the_script_before_launch(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode0 slots=1\nnode2 slot=1\n")
    path = tiny_config(tmp_path)
    proc = run([str(REPO / "launch" / "multinode_no_ssh.sh"), str(hostfile), "0", "127.0.0.1", str(path)],
               expect_ok=False, timeout=120)
    assert proc.returncode == 2
    assert f"{hostfile}:2: host 'node0' is listed again (first on line 1)" in proc.stderr
    assert f"{hostfile}:3: 'node2 slot=1' is not 'HOSTNAME slots=N'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_world_size_not_dividing_the_batch_fails_on_every_rank(tmp_path):
    """3 ranks cannot split 8 tasks/meta-step of 4-task micro-batches: each rank says so and
    exits before the first collective (no rank waits for a peer).

    The ranks are started as independent processes with the launcher's environment: under a
    launcher, the first rank to exit gets its peers killed, so how many of them print the message
    there is a race. Here every rank must print it and exit 2 within the timeout on its own."""
    path = tiny_config(tmp_path)
    port = str(free_port())
    message = "meta.tasks_per_meta_step (8) must be a multiple of meta.tasks_per_micro_batch (4) x world size (3)"
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
               "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([str(BIN / "gmeta-ds"), "train", "--config", str(path)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 2, f"rank {rank}: {out[-2000:]}{err[-3000:]}"
        assert message in err, f"rank {rank}: {err[-3000:]}"
        assert "Traceback" not in err
    # Under the deepspeed launcher the job fails with the same message (at least the first rank's).
    proc = run(deepspeed_cmd(3, str(BIN / "gmeta-ds"), "train", "--config", str(path)),
               expect_ok=False, timeout=180)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_missing_and_conflicting_deepspeed_configs(tmp_path):
    path = tiny_config(tmp_path)
    base = [str(BIN / "gmeta-ds"), "train", "--config", str(path)]
    proc = run([*base, "--deepspeed", "--deepspeed_config", str(tmp_path / "nope.json")],
               expect_ok=False, timeout=120)
    assert proc.returncode == 2
    assert f"--deepspeed_config: DeepSpeed config file '{tmp_path / 'nope.json'}' does not exist" in proc.stderr
    accel_env = {"ACCELERATE_USE_DEEPSPEED": "true",
                 "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / "ds_configs" / "zero1.json")}
    proc = run([*base, "--deepspeed_config", str(REPO / "ds_configs" / "zero2.json")], env=accel_env,
               expect_ok=False, timeout=120)
    assert proc.returncode == 2
    assert "the launch names two different DeepSpeed configs" in proc.stderr
    assert not (tmp_path / "run").exists()
