import time, json, socket, sys, subprocess, threading, trio, coredis
from coredis.connection import TCPLocation
from loadtest.redis_cluster import running_cluster
from loadtest.redis_server import running_redis
from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat import encoders
from servers.heartbeat.coordination.fleet.keys import FleetKeys
mode, n = sys.argv[1], int(sys.argv[2])
def connect(port, cid):
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(encoders.encode_connect(cid, keep_alive=120)); s.recv(4); return s
def lags(r):
    async def main():
        if mode == "cluster":
            c = coredis.RedisCluster(startup_nodes=[TCPLocation("127.0.0.1", s.port) for s in r.servers]); streams = [s.stream for s in FleetKeys("idlekeeper:", "x", 16).shards]
        else:
            c = coredis.Redis(port=r.port); streams = ["idlekeeper:presence"]
        w = []
        async with c:
            for st in streams:
                for e in await c.xrange(st, "-", "+"):
                    ev = json.loads(e.field_values[b"event"]); w.append(int(e.identifier.split(b"-")[0]) / 1000 - ev["time"])
        w.sort(); print(mode, "write lag p50", round(w[len(w)//2],3), "p99", round(w[int(len(w)*.99)],3), len(w))
    trio.run(main)
with (running_cluster() if mode == "cluster" else running_redis()) as r:
    url = r.url + ("/?shards=16" if mode == "cluster" else "")
    gws = []
    for g in range(2):
        port = free_port()
        gws.append((start_heartbeat(port, 3, ["--cluster", url, "--node", f"gw{g}", "--status-port", str(free_port(run=3))]), port))
    socks = []
    t = time.time()
    for i in range(n):
        socks.append(connect(gws[i % 2][1], f"d-{i}"))
        target = t + i / 1000
        if time.time() < target: time.sleep(target - time.time())
    print("connected in", round(time.time() - t, 1))
    if len(sys.argv) > 3:
        pid = gws[0][0].pid
        subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True)
    time.sleep(5)
    lags(r)
    for s in socks: s.close()
    for p, _ in gws: p.terminate(); p.wait()
