"""Scale-out: `prism serve --replicas 2` (two tritonservers behind the nginx router) on loopback.

Routing by the material key, bit-identical answers from every replica, repeats served from one
replica's prefix cache, the urgent lane end to end, failover when a replica is killed, restart,
and a clean stop of the whole group.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from helpers import (REPO_ROOT, THREADS, TICKETS, Cluster, exit_timeouts, free_port, metric, scrape_url,
                     stop_cleanly, wait_for)
from prism_client.client import ROUTE_HEADER, PrismClient, route_key
from prism_launcher.cluster import PrismCluster
from prism_launcher.router import Replica, RouterOptions, NginxRouter, read_access_log, render_nginx_conf
from prism_launcher.server import python_stubs
from prism_backend.config import ConfigError

ADMIN_TOKEN = "test-admin-token-0123456789"


class FakeServer:
    """What PrismCluster.heal asks of a TritonServer, scripted (no process)."""

    def __init__(self, failures=(), loads=0):
        self.failures, self.loads, self.ready, self.calls = list(failures), loads, True, []

    def failure(self):
        return self.failures.pop(0) if self.failures else None

    def kill(self):
        self.calls.append("kill")

    def launch(self):
        self.calls.append("launch")
        self.ready = False
        return self

    def started(self, ready_timeout):
        if self.loads == "exits":
            raise RuntimeError("tritonserver exited with code 1")
        self.loads -= 1
        self.ready = self.loads < 0
        return self.ready


def test_heal_relaunches_without_waiting_and_reports_readiness_later():
    """heal() never waits for a load: each call is one look at every replica."""
    cluster = PrismCluster.__new__(PrismCluster)
    cluster.servers = [FakeServer(), FakeServer(failures=["tritonserver exited with code -9"], loads=2)]
    assert cluster.heal() == [(1, "failed (tritonserver exited with code -9); restarting")]
    assert cluster.servers[1].calls == ["kill", "launch"] and cluster.servers[0].calls == []
    assert cluster.heal() == [] and cluster.heal() == []  # still loading: nothing to report, nothing relaunched
    assert cluster.heal() == [(1, "ready again")]
    assert cluster.heal() == [] and cluster.servers[1].calls == ["kill", "launch"]
    cluster.servers[0] = FakeServer(failures=["Python-backend stub(s) [7] died"], loads="exits")
    assert cluster.heal() == [(0, "failed (Python-backend stub(s) [7] died); restarting")]
    with pytest.raises(RuntimeError, match="exited"):  # a relaunch that cannot load is an error, as a first start
        cluster.heal()


def test_route_key_depends_on_system_and_material_only():
    assert route_key("ticket") == route_key(b"ticket") == route_key("ticket", None)
    assert route_key("ticket") != route_key("ticket 2")
    assert route_key("ticket") != route_key("ticket", system="Be terse.")
    assert re.fullmatch(r"[0-9a-f]{32}", route_key("ticket"))


def test_rendered_router_config_is_valid_nginx(tmp_path):
    replicas = [Replica("127.0.0.1:9000", "127.0.0.1:9001"), Replica("127.0.0.1:9010", "127.0.0.1:9011")]
    router = NginxRouter(replicas, RouterOptions(http_listen="127.0.0.1:9100", grpc_listen="127.0.0.1:9101"), tmp_path)
    text = router.write_conf().read_text()  # runs `nginx -t` on it
    assert text.count("hash $http_x_prism_route consistent;") == 2  # HTTP and gRPC keyed pools
    assert "default prism_http_keyed" in text and "default prism_grpc_keyed" in text
    assert text.count("server 127.0.0.1:9000 max_fails=1") == 2 and "server 127.0.0.1:9011" in text
    round_robin = render_nginx_conf(replicas, RouterOptions(balance="round-robin"), str(tmp_path))
    assert "default prism_http_any" in round_robin and "default prism_http_keyed" not in round_robin
    with pytest.raises(ConfigError, match="balance"):
        render_nginx_conf(replicas, RouterOptions(balance="random"), None)
    with pytest.raises(ConfigError, match="at least one replica"):
        render_nginx_conf([], RouterOptions(), None)


def test_router_dies_with_its_launcher(tmp_path):
    """A launcher killed without its cleanup (SIGKILL) leaves no nginx behind."""
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from prism_launcher.router import NginxRouter, Replica, RouterOptions\n"
        f"r = NginxRouter([Replica('127.0.0.1:9', '127.0.0.1:10')], RouterOptions("
        f"http_listen='127.0.0.1:{free_port()}', grpc_listen='127.0.0.1:{free_port()}'), Path(sys.argv[1]))\n"
        "r.start()\n"
        "print(r.process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT)
    pid = int(done.stdout.split()[0])

    def gone() -> bool:
        try:
            return "nginx" not in Path(f"/proc/{pid}/cmdline").read_text() or \
                Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        except OSError:
            return True

    assert wait_for(gone, 10)


def test_kubernetes_manifest_is_the_committed_one_and_carries_the_router_config(tmp_path):
    import yaml

    from prism_launcher.kubernetes import COMMITTED, manifest

    assert COMMITTED.read_text() == manifest(2)  # regenerate with `prism k8s --replicas 2`
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(manifest(3))}
    assert docs[("StatefulSet", "prism")]["spec"]["replicas"] == 3
    assert docs[("Service", "prism")]["spec"]["clusterIP"] == "None"
    conf = docs[("ConfigMap", "prism-router")]["data"]["nginx.conf"]
    for i in range(3):
        assert f"server prism-{i}.prism.default.svc.cluster.local:8000 max_fails=1" in conf
    assert "hash $http_x_prism_route consistent;" in conf
    # the container form (logs to stdout/stderr, image paths) is valid nginx too, here with loopback replicas
    local = conf.replace("prism-0.prism.default.svc.cluster.local", "127.0.0.1")
    local = local.replace("prism-1.prism.default.svc.cluster.local", "127.0.0.2")
    local = local.replace("prism-2.prism.default.svc.cluster.local", "127.0.0.3")
    (tmp_path / "nginx.conf").write_text(local)
    from prism_launcher.router import nginx_binary

    check = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # each pod: tritonserver on loopback with its admin APIs restricted, the same front as a sidecar
    pod = docs[("StatefulSet", "prism")]["spec"]["template"]["spec"]["containers"]
    triton, front = pod[0], pod[1]
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(triton["command"])
    assert "--disable-auto-complete-config" in triton["command"]  # as `prism serve` starts it
    assert any(a.startswith("--http-restricted-api=shared-memory,model-repository,trace,logging:x-prism-admin-token=$(")
               for a in triton["command"])
    assert triton["livenessProbe"]["exec"]["command"][:2] == ["prism", "health"]
    pod_conf = docs[("ConfigMap", "prism-front")]["data"]["nginx.conf"]
    assert "server 127.0.0.1:18000 max_fails=1" in pod_conf and "admin APIs are closed" in pod_conf
    assert front["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    (tmp_path / "pod.conf").write_text(pod_conf)
    check = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(tmp_path / "pod.conf")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(env={"PRISM_ADMIN_TOKEN": ADMIN_TOKEN})
    yield c
    stop_cleanly(c)  # a failed or deselected stop test: stop it the way Ctrl-C does


def routed_entries(cluster, since: int, count: int | None = None) -> list[dict]:
    """Inference entries of the router's access log after line `since`; waits for `count` of them
    (nginx writes an entry just after the response has gone out)."""
    def entries():
        return [e for e in read_access_log(cluster.access_log)[since:]
                if e["uri"].endswith("/infer") or e["uri"].endswith("/ModelInfer")]

    if count is not None:
        assert wait_for(lambda: len(entries()) >= count, 10)
    return entries()


def test_requests_route_by_material_key(cluster):
    start = len(read_access_log(cluster.access_log))
    http, grpc = PrismClient(cluster.url), PrismClient(f"127.0.0.1:{cluster.grpc_port}", "grpc")
    for material in THREADS:
        http.decide(material, ["team"])
        http.decide(material, ["severity"])
        grpc.decide(material, ["reply_time"])
        grpc.decide(material, ["team"])
    by_key = defaultdict(lambda: defaultdict(set))
    for e in routed_entries(cluster, start, 4 * len(THREADS)):
        protocol = "grpc" if e["uri"].endswith("ModelInfer") else "http"
        by_key[protocol][e["route"]].add(e["upstream"])
    keys = {route_key(m) for m in THREADS}
    for protocol in ("http", "grpc"):
        assert set(by_key[protocol]) == keys
        assert all(len(upstreams) == 1 for upstreams in by_key[protocol].values())  # a key sticks to one replica
        used = set().union(*by_key[protocol].values())
        assert len(used) == 2  # and the keys spread over both replicas (12 keys: all on one is 2^-11)


def test_every_replica_returns_identical_bits(cluster):
    requests = [(THREADS[0], ["team", "severity"]), (TICKETS[100], ["reply_time"]), ("Printer on fire.", ["team"])]
    answers = []
    for address in [r["http"] for r in cluster.replicas] + [cluster.url]:
        with PrismClient(address) as client:  # closed: a replica's stop waits for open connections
            answers.append([np.concatenate([d.probability_array() for d in client.decide(m, t)]).tobytes()
                            for m, t in requests])
    grpc = PrismClient(f"127.0.0.1:{cluster.grpc_port}", "grpc")
    answers.append([np.concatenate([d.probability_array() for d in grpc.decide(m, t, urgent=True)]).tobytes()
                    for m, t in requests])
    assert all(a == answers[0] for a in answers[1:])


def test_repeats_are_served_from_one_replicas_prefix_cache(cluster):
    reused = [metric(scrape_url(r["metrics"]), "prism_prefix_cache_tokens_reused_total") for r in cluster.replicas]
    start = len(read_access_log(cluster.access_log))
    client = PrismClient(cluster.url)
    fresh = ["\n\n".join(TICKETS[200 + 4 * i : 204 + 4 * i]) for i in range(4)]
    for material in fresh:
        client.decide(material, ["team"])
    for material in fresh:  # the same tickets again, new questions
        client.decide(material, ["severity"])
    entries = routed_entries(cluster, start, 8)
    after = [metric(scrape_url(r["metrics"]), "prism_prefix_cache_tokens_reused_total") for r in cluster.replicas]
    gained = [a - b for a, b in zip(after, reused)]
    # each repeat went where its first question went, and found at least its first 128-token block there
    for first, repeat in zip(entries[:4], entries[4:]):
        assert first["route"] == repeat["route"] and first["upstream"] == repeat["upstream"]
    per_replica = defaultdict(int)
    for e in entries[4:]:
        per_replica[cluster.replica_of(e["upstream"])] += 1
    for index, repeats in per_replica.items():
        assert gained[index] >= 128 * repeats


def test_requests_without_key_are_balanced_round_robin(cluster):
    start = len(read_access_log(cluster.access_log))
    body = json.dumps({"inputs": [
        {"name": "material", "shape": [1], "datatype": "BYTES", "data": ["Screen flickers."]},
        {"name": "tasks", "shape": [1], "datatype": "BYTES", "data": ["team"]}]}).encode()
    replicas = []
    for _ in range(4):
        request = urllib.request.Request(f"http://{cluster.url}/v2/models/prism/infer", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            assert response.status == 200
            replicas.append(response.headers["x-prism-replica"])
    assert [e["route"] for e in routed_entries(cluster, start, 4)] == ["-"] * 4
    assert len(set(replicas)) == 2  # alternating, not pinned


def test_urgent_lane_is_accepted_end_to_end(cluster):
    """The client's urgent flag is the request parameter "urgent": true, which prism_decision's
    scheduler reads (through the ensemble) to serve the request ahead of queued bulk ones; its bits
    are the bulk lane's. Triton's own priority levels stay off (they stop its batcher's prefetch)."""
    http = PrismClient(cluster.url)
    normal = http.decide(THREADS[1], ["team"])[0]
    urgent = http.decide(THREADS[1], ["team"], urgent=True)[0]
    assert urgent.probability_array().tobytes() == normal.probability_array().tobytes()
    body = json.dumps({"parameters": {"urgent": True}, "inputs": [
        {"name": "material", "shape": [1], "datatype": "BYTES", "data": [THREADS[1]]},
        {"name": "tasks", "shape": [1], "datatype": "BYTES", "data": ["team"]}]}).encode()
    request = urllib.request.Request(f"http://{cluster.url}/v2/models/prism/infer", body,
                                     {"Content-Type": "application/json", ROUTE_HEADER: route_key(THREADS[1])})
    with urllib.request.urlopen(request) as response:
        decision = json.loads(json.loads(response.read())["outputs"][0]["data"][0])
    assert decision["probabilities"] == normal.probabilities
    cli = subprocess.run([sys.executable, "-m", "prism_launcher.cli", "decide", "--material",
                          str(REPO_ROOT / "samples" / "ticket.txt"), "--task", "team", "--urgent", "--json",
                          "--url", cluster.url], capture_output=True, text=True, cwd=REPO_ROOT)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)[0]["task"] == "team"
    urgent_waits = sum(v for r in cluster.replicas for k, v in scrape_url(r["metrics"]).items()
                       if k.startswith("prism_queue_wait_seconds_count{") and 'lane="urgent"' in k)
    assert urgent_waits >= 3  # the client's, the raw request's and the CLI's went through the urgent lane
    with urllib.request.urlopen(f"http://{cluster.replicas[0]['http']}/v2/models/prism_decision/config") as r:
        batching = json.loads(r.read())["dynamic_batching"]
    assert not batching.get("priority_levels") and not batching.get("default_queue_policy")


def test_front_rules_hold_through_the_router(cluster):
    """The checks of tests/test_security.py, through `--replicas 2`: the same front, the same rules."""
    from test_security import check_admin_apis_locked, check_chunked_flood, check_oversized_requests

    check_chunked_flood(cluster.url, ADMIN_TOKEN)
    check_admin_apis_locked(cluster.url, f"127.0.0.1:{cluster.grpc_port}", ADMIN_TOKEN)
    check_oversized_requests(cluster.url)
    for index in range(2):
        assert wait_for(lambda: all(cluster.server_pids(i) for i in range(2)), 5)
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/replicas/{index}/metrics") as r:
            assert b"prism_requests_total" in r.read()


def test_dead_stub_of_one_replica_fails_over_then_heals(cluster):
    """SIGKILL of one replica's decision stub: its keys are answered by the other replica with the
    same bits, and `prism serve` restarts it."""
    client = PrismClient(cluster.url)
    start = len(read_access_log(cluster.access_log))
    expected = client.decide(THREADS[2], ["team"])[0]
    victim = cluster.replica_of(routed_entries(cluster, start, 1)[0]["upstream"])
    (pid,) = cluster.server_pids(victim)
    (stub,) = [s for s in python_stubs(pid) if b"prism_decision" in Path(f"/proc/{s}/cmdline").read_bytes()]
    os.kill(stub, signal.SIGKILL)
    assert wait_for(lambda: cluster.server_pids(victim) != [pid], 10)  # the launcher noticed: killed, restarting
    start = len(read_access_log(cluster.access_log))
    again = [client.decide(THREADS[2], ["team"])[0] for _ in range(3)]  # meanwhile: the other replica
    assert all(d.probabilities == expected.probabilities for d in again)
    survivor = cluster.replicas[1 - victim]["http"]
    assert all(e["upstream"].split(", ")[-1] == survivor for e in routed_entries(cluster, start, 3))
    with PrismClient(cluster.replicas[victim]["http"]) as healed:
        assert wait_for(lambda: f"replica {victim} failed" in cluster.stderr_path.read_text() and healed.is_ready(), 900)
        assert healed.decide(THREADS[2], ["team"])[0].probabilities == expected.probabilities

    def routed_back() -> bool:
        start = len(read_access_log(cluster.access_log))
        client.decide(THREADS[2], ["team"])
        return routed_entries(cluster, start, 1)[0]["upstream"] == cluster.replicas[victim]["http"]
    # and the router takes it back once its fail_timeout (10 s) has passed since it found it down: the
    # key is its own again (and the next test starts with both replicas in the ring)
    assert wait_for(routed_back, 30)


def test_killed_replica_is_taken_out_then_restarted(cluster):
    client = PrismClient(cluster.url)
    start = len(read_access_log(cluster.access_log))
    client.decide(THREADS[0], ["team"])
    victim = cluster.replica_of(routed_entries(cluster, start, 1)[0]["upstream"])  # THREADS[0]'s replica
    assert cluster.server_pids(victim)
    regions = cluster.shared_memory_regions(victim)  # its stubs' (a killed server cannot remove them)
    assert len(regions) >= 3 and all(r.name.startswith("prism_") for r in regions), regions
    log_start = len(cluster.stderr_path.read_text())
    cluster.kill_replica(victim)
    start = len(read_access_log(cluster.access_log))
    # THREADS[0]'s key goes to the victim; about half of the others too. (Within
    # the router's 10 s fail_timeout, before the restarted replica can take its keys back.)
    routed = [client.decide(material, ["team"])[0] for material in THREADS[:6]]
    entries = routed_entries(cluster, start, 6)
    survivor = cluster.replicas[1 - victim]["http"]
    assert all(e["status"] == "200" for e in entries)
    assert {e["upstream"].split(", ")[-1] for e in entries} == {survivor}
    # the first request for the dead replica's keys was retried on the other one, the rest went there directly
    assert entries[0]["upstream"] == f"{cluster.replicas[victim]['http']}, {survivor}"
    with PrismClient(survivor) as reference:
        for material, got in zip(THREADS[:6], routed):
            assert got.probabilities == reference.decide(material, ["team"])[0].probabilities
    # `prism serve --replicas` notices (naming the server, though its stubs died with it) and
    # starts the replica again on its ports
    assert wait_for(lambda: f"replica {victim} failed (tritonserver exited with code -9); restarting"
                    in cluster.log_since(log_start), 10)
    assert wait_for(lambda: f"replica {victim} ready again" in cluster.log_since(log_start), 900)
    assert not [r for r in regions if r.exists()]  # removed before the relaunch, not left in /dev/shm
    with PrismClient(cluster.replicas[victim]["http"]) as again:
        assert again.is_ready()
        assert again.decide(THREADS[0], ["team"])[0].probabilities == client.decide(THREADS[0], ["team"])[0].probabilities


def test_stop_ends_router_and_every_replica(cluster):
    """Ctrl-C while a replica is being restarted (its new server still loading): the watch does not
    wait for the load, so everything stops at once, and no server waits out its exit timeout."""
    assert cluster.group_processes()  # nginx, two tritonservers, their stubs
    log_start = len(cluster.stderr_path.read_text())
    cluster.kill_replica(1)
    assert wait_for(lambda: "replica 1 failed (tritonserver exited with code -9); restarting"
                    in cluster.log_since(log_start), 10)
    assert cluster.server_pids(1)  # the new server, loading
    took = stop_cleanly(cluster)
    assert "replica 1 ready again" not in cluster.log_since(log_start)
    assert not exit_timeouts(cluster)
    print(f"clean stop during a restart: {took:.1f} s")
