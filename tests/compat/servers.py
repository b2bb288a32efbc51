"""Servers the suite starts inside sandboxes. Stdlib only: the base image has python3 and no network."""

# Echo over HTTP: POST returns the body's length and sha256; GET /stream sends 5 chunks 200 ms apart.
HTTP_SERVER = r"""
import hashlib, http.server, json, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        left, digest = int(self.headers["Content-Length"]), hashlib.sha256()
        while left:
            chunk = self.rfile.read(min(left, 1 << 16)); left -= len(chunk); digest.update(chunk)
        self.reply(200, {"path": self.path, "sha256": digest.hexdigest(), "host": self.headers["Host"]})
    def do_GET(self):
        if self.path != "/stream":
            return self.reply(200, {"path": self.path})
        self.send_response(200); self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        for i in range(5):
            line = f"chunk {i} {time.time()}\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line)); self.wfile.flush(); time.sleep(0.2)
        self.wfile.write(b"0\r\n\r\n")
    def reply(self, status, obj):
        out = json.dumps(obj).encode()
        self.send_response(status); self.send_header("Content-Type", "application/json")
        self.send_header("Set-Cookie", "a=1"); self.send_header("Set-Cookie", "b=2")
        self.send_header("Content-Length", str(len(out))); self.end_headers(); self.wfile.write(out)
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# A minimal RFC 6455 echo server: text and binary messages come back, "close" closes with 4001.
WEBSOCKET_SERVER = r"""
import base64, hashlib, socket, struct, sys, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def read_exact(conn, n):
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part: raise EOFError
        buf += part
    return buf
def send_frame(conn, opcode, data):
    head = bytes([0x80 | opcode])
    n = len(data)
    if n < 126: head += bytes([n])
    elif n < 65536: head += bytes([126]) + struct.pack("!H", n)
    else: head += bytes([127]) + struct.pack("!Q", n)
    conn.sendall(head + data)
def serve(conn):
    request = b""
    while b"\r\n\r\n" not in request:
        request += conn.recv(4096)
    headers = dict(l.split(": ", 1) for l in request.decode().split("\r\n")[1:] if ": " in l)
    headers = {k.lower(): v for k, v in headers.items()}
    if "sec-websocket-key" not in headers:
        conn.sendall(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return conn.close()
    accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode() + GUID).digest()).decode()
    extra = ""
    if "sec-websocket-protocol" in headers:
        extra = "Sec-WebSocket-Protocol: " + headers["sec-websocket-protocol"].split(",")[0].strip() + "\r\n"
    conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Accept: {accept}\r\n{extra}\r\n").encode())
    message, kind = b"", 1
    try:
        while True:
            b1, b2 = read_exact(conn, 2)
            n = b2 & 0x7F
            if n == 126: n = struct.unpack("!H", read_exact(conn, 2))[0]
            elif n == 127: n = struct.unpack("!Q", read_exact(conn, 8))[0]
            mask = read_exact(conn, 4) if b2 & 0x80 else b"\0\0\0\0"
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(read_exact(conn, n)))
            opcode = b1 & 0x0F
            if opcode == 8:
                send_frame(conn, 8, data[:2]); return
            if opcode == 9:
                send_frame(conn, 10, data); continue
            if opcode in (1, 2): message, kind = data, opcode
            elif opcode == 0: message += data
            if not b1 & 0x80: continue
            if kind == 1 and message == b"close":
                send_frame(conn, 8, struct.pack("!H", 4001) + b"asked to"); return
            if kind == 1 and message == b"headers":
                send_frame(conn, 1, repr(sorted(headers)).encode()); continue
            send_frame(conn, kind, message)
    except EOFError:
        pass
    finally:
        conn.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
