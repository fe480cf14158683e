#!/usr/bin/env python3
# Launcher test program: a rendezvous without LibTorch. Global rank 0 listens on
# MASTER_ADDR:MASTER_PORT; every other rank connects and sends its RANK; rank 0 checks it
# heard from ranks 1..WORLD_SIZE-1 and answers each with the sorted list.
import os, socket, sys, time

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
deadline = time.time() + 15
if rank == 0:
    server = socket.create_server((addr, port))
    server.settimeout(15)
    peers = [server.accept()[0] for _ in range(world - 1)]
    ranks = sorted(int(p.recv(64).decode()) for p in peers)
    if ranks != list(range(1, world)):
        sys.exit(f"rank 0 heard from {ranks}")
    for p in peers:
        p.sendall(" ".join(map(str, ranks)).encode())
        p.close()
    print(f"rendezvous: rank 0 met ranks {ranks} of world {world}")
else:
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=15)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    conn.sendall(str(rank).encode())
    print(f"rendezvous: rank {rank} joined world {world}: {conn.recv(256).decode()}")
