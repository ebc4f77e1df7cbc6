"""A real JupyterHub on this machine for tests/test_hub.py: Unix users made with useradd, a
course environment every learner can read, the hub (LocalProcessSpawner, the configuration
docs/instructors.md gives), its REST API, cells sent to a kernel over its websocket, a
JupyterLab terminal, and what another user can see of a learner's sockets.

Root only. `why_no_hub()` says in one sentence why a hub cannot be brought up here."""
import json
import os
import pwd
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
PROXY = "configurable-http-proxy"


def why_no_hub():
    """None when a hub can be brought up here, else why not (one sentence)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the hub test makes Unix users and spawns servers as them: it needs root"
    for tool in ("useradd", "userdel", "runuser", "taskset"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        import jupyterhub  # noqa: F401
        import websocket  # noqa: F401  (websocket-client)
    except ImportError as e:
        return f"{e.name} is not installed (.ci/run installs it: python -m pip install jupyterhub)"
    if shutil.which(PROXY) is None:
        return f"{PROXY} is not on PATH (.ci/run installs it: npm install -g {PROXY})"
    return None


def free_ports(n):
    """n different free ports: all held open together while picked, since a port picked and
    let go can be picked again (seen: the hub and the proxy's API given the same port)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def others_can_use(path):
    """True when a user other than the owner can reach `path`: every folder above it
    searchable by others, and the path itself readable by others."""
    path = Path(path).resolve()
    if not path.stat().st_mode & stat.S_IROTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def course_python(base):
    """An interpreter with torch, JupyterLab and jupyterhub that every learner can run.

    This interpreter itself when others can use it; else (pyenv under a 0700 /root, the
    guide's "venv under a 0700 home" pitfall) a venv made from the system's python of the same
    version under `base`, seeing this interpreter's site-packages through a read-only bind mount
    (else a hard-linked copy: seconds, no download). Returns (python, why) or (None, why not)."""
    if others_can_use(sys.executable) and others_can_use(Path(sys.prefix)):
        return sys.executable, "this interpreter is readable by every user"
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(f"python{v}", path="/usr/bin:/usr/local/bin")
    if system is None:
        return None, f"{sys.executable} is not readable by other users and there is no system python{v}"
    import site
    parts = {Path(site.getsitepackages()[0]): base / "site-packages"}
    for part in ("etc/jupyter", "share/jupyter"):   # server extensions enabled, JupyterLab's assets, kernels
        if (Path(sys.prefix) / part).is_dir():
            parts[Path(sys.prefix) / part] = base / "venv" / part
    venv = base / "venv"
    subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    for source, copy in parts.items():
        copy.mkdir(parents=True, exist_ok=True)
        # a read-only bind mount (instant; remove_base() undoes it), else hard links (seconds)
        if subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(copy)], capture_output=True).returncode:
            copy.rmdir()
            out = subprocess.run(["cp", "-al", str(source), str(copy)], capture_output=True, text=True)
            if out.returncode:
                return None, f"cannot give the learners {source}: {out.stderr.strip()}"
    (venv / "lib" / f"python{v}" / "site-packages" / "course.pth").write_text(f"{base / 'site-packages'}\n")
    site_packages = list(parts)[0]
    return str(venv / "bin" / "python"), f"a venv from {system} seeing {site_packages} through {base}"


def mounts_under(base):
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return sorted((m for m in mounts if m.startswith(f"{base}/")), key=len, reverse=True)


def remove_base(base):
    """Undo course_python's bind mounts under base (deepest first), then remove base; never
    while a mount is left there: rm would reach into the course interpreter's own files."""
    for m in mounts_under(base):
        subprocess.run(["umount", m], capture_output=True)
    left = mounts_under(base)
    if left:
        raise RuntimeError(f"still mounted, {base} left in place: {left}")
    subprocess.run(["rm", "-rf", "--one-file-system", str(base)])


def make_user(name):
    """A fresh Unix user with a home made by useradd -m (mode as the system makes it)."""
    drop_user(name)
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, capture_output=True)
    return pwd.getpwnam(name)


def drop_user(name):
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for p in user_processes(uid):
        try:
            p.kill()
        except psutil.Error:
            pass
    for path in owned_in(["/tmp", "/dev/shm"], uid):    # what its runs left there (a deleted
        subprocess.run(["rm", "-rf", "--one-file-system", path])   # user's uid is given out again)
    subprocess.run(["userdel", "-r", "-f", name], capture_output=True)


def user_processes(uid):
    out = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid:
                out.append(p)
        except psutil.Error:
            pass
    return out


def owned_in(folders, uid):
    """Entries directly in `folders` owned by uid (what a user left in /tmp or /dev/shm)."""
    found = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            try:
                if os.lstat(os.path.join(folder, name)).st_uid == uid:
                    found.append(os.path.join(folder, name))
            except OSError:
                pass
    return sorted(found)


# --- the hub ---

HUB_CONFIG = '''\
# The CPU-room configuration of docs/instructors.md, with the test's ports and paths.
import json
COURSE_PYTHON = {python!r}
LEARNERS = {learners!r}            # learner -> the cores they may use (taskset -c)

c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.pid_file = {pid_file!r}
c.JupyterHub.db_url = "sqlite:///{db}"
c.JupyterHub.cookie_secret_file = {cookie!r}
c.Authenticator.allowed_users = set(LEARNERS)
c.Spawner.notebook_dir = "~/ddp-lesson"     # notebooks/ and docs/: the notebooks' ../docs links resolve
c.Spawner.default_url = "/lab/tree/notebooks/00_start_here.ipynb"
c.Spawner.environment = {{
    "PATH": {path!r},
    "PYTHONPATH": {pythonpath!r},
}}
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180

def pin(spawner):
    """Each learner's server, kernels and runs on their own cores."""
    spawner.cmd = ["taskset", "-c", LEARNERS[spawner.user.name], COURSE_PYTHON, "-m", "jupyterhub.singleuser"]

c.Spawner.pre_spawn_hook = pin

# the test's own access: a service token that may make users, start servers and make tokens
c.JupyterHub.services = [{{"name": "course-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "course-test", "services": ["course-test"],
                             "scopes": ["admin:users", "admin:servers", "tokens", "list:users",
                                        "read:users", "access:servers"]}}]
'''


class Hub:
    """JupyterHub as a child of this (root) process, in folder `base`, with `learners`
    (name -> cores) as its allowed users. Use as a context manager: the hub and the proxy stop
    and their files go on exit (the users are the caller's)."""

    def __init__(self, base, python, learners, pythonpath):
        import requests
        self.http = requests.Session()
        self.base = Path(base)
        self.python = python
        self.port, hub_port, proxy_api_port = free_ports(3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self.http.headers["Authorization"] = f"token {self.token}"
        hub_dir = self.base / "hub"
        hub_dir.mkdir(mode=0o700)
        self.config = hub_dir / "jupyterhub_config.py"
        self.config.write_text(HUB_CONFIG.format(
            python=python, learners=learners, port=self.port, hub_port=hub_port,
            proxy_api_port=proxy_api_port, pid_file=str(hub_dir / "proxy.pid"),
            db=hub_dir / "jupyterhub.sqlite", cookie=str(hub_dir / "cookie_secret"),
            path=f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin", pythonpath=pythonpath,
            token=self.token))
        self.log = hub_dir / "hub.log"
        self.proc = None

    def __enter__(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DDP_LESSON", "JUPYTER"))}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(self.config)],
                                         cwd=self.config.parent, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 120
        while True:
            try:
                if self.http.get(f"{self.url}/hub/api/", timeout=5).status_code == 200:
                    return self
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("the hub did not come up:\n" + self.log_tail())
            time.sleep(0.3)

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()    # the hub stops the proxy; the servers are stopped by then
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()

    def log_tail(self, chars=4000):
        return self.log.read_text(errors="replace")[-chars:]

    def api(self, method, path, expect=(200, 201, 202, 204), **kw):
        r = self.http.request(method, f"{self.url}/hub/api{path}", timeout=60, **kw)
        assert r.status_code in expect, (method, path, r.status_code, r.text, self.log_tail())
        return r.json() if r.content else None

    def add_users(self, names):
        self.api("POST", "/users", json={"usernames": list(names)}, expect=(201, 409))

    def start_server(self, name):
        """Spawn the learner's server through the hub's API; returns when the hub calls it ready."""
        self.api("POST", f"/users/{name}/server")
        end = time.monotonic() + 240
        while True:
            server = (self.api("GET", f"/users/{name}").get("servers") or {}).get("")
            if server and server.get("ready"):
                return server
            assert time.monotonic() < end, f"{name}'s server never got ready:\n{self.log_tail()}"
            time.sleep(0.5)

    def stop_server(self, name):
        """DELETE the server through the hub's API; returns when the hub says it is gone."""
        self.api("DELETE", f"/users/{name}/server")
        end = time.monotonic() + 120
        while (self.api("GET", f"/users/{name}").get("servers") or {}).get(""):
            assert time.monotonic() < end, f"{name}'s server did not stop:\n{self.log_tail()}"
            time.sleep(0.3)

    def user_token(self, name):
        return self.api("POST", f"/users/{name}/tokens", json={"expires_in": 3600, "note": "course-test"})["token"]


class Learner:
    """One learner's side of the hub: their token, a notebook session, its kernel's websocket."""

    def __init__(self, hub, name):
        import requests
        self.hub, self.name = hub, name
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {hub.user_token(name)}"
        self.base = f"{hub.url}/user/{name}"
        self.ws = None

    def api(self, method, path, **kw):
        r = self.http.request(method, f"{self.base}/api{path}", timeout=60, **kw)
        assert r.status_code < 300, (method, path, r.status_code, r.text)
        return r.json() if r.content else None

    def open_notebook(self, path):
        """A session for the notebook (its kernel runs in the notebook's folder), and the
        kernel's websocket."""
        import websocket
        session = self.api("POST", "/sessions", json={"path": path, "type": "notebook",
                                                       "kernel": {"name": "python3"}})
        kernel = session["kernel"]["id"]
        ws_url = self.base.replace("http://", "ws://") + f"/api/kernels/{kernel}/channels"
        self.ws = websocket.create_connection(
            ws_url, header=["Authorization: " + self.http.headers["Authorization"]], timeout=30)
        self.session = uuid.uuid4().hex
        return kernel

    def execute(self, code, timeout=300):
        """Run one cell in the kernel, as JupyterLab sends it: returns (stdout, error or None)."""
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": self.name, "session": self.session,
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
        out, error, idle, replied = [], None, False, False
        end = time.monotonic() + timeout
        while not (idle and replied):
            self.ws.settimeout(max(1.0, end - time.monotonic()))
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name}: the cell did not finish in {timeout} s; output so far:\n"
                                   + "".join(out))
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "execute_result":
                out.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
            elif kind == "execute_reply":
                replied = True
        return "".join(out), error

    def run(self, code, timeout=300):
        """execute(), failing on a cell error; returns the last stdout line parsed as JSON."""
        out, error = self.execute(textwrap.dedent(code), timeout)
        assert error is None, f"{self.name}: {error}\n{out}"
        return json.loads(out.strip().splitlines()[-1])

    def terminal(self, command, expect, timeout=60):
        """Type `command` into a new JupyterLab terminal (a login shell, as a learner gets) and
        return what it printed up to `expect`."""
        import websocket
        name = self.api("POST", "/terminals")["name"]
        ws = websocket.create_connection(self.base.replace("http://", "ws://") + f"/terminals/websocket/{name}",
                                         header=["Authorization: " + self.http.headers["Authorization"]], timeout=timeout)
        try:
            ws.send(json.dumps(["stdin", command + "\r"]))
            text, end = "", time.monotonic() + timeout
            while expect not in text.split(command, 1)[-1]:
                assert time.monotonic() < end, f"no {expect!r} in {timeout} s:\n{text}"
                ws.settimeout(max(1.0, end - time.monotonic()))
                msg = json.loads(ws.recv())
                if msg[0] == "stdout":
                    text += msg[1]
            return text.split(command, 1)[-1]
        finally:
            ws.close()
            self.api("DELETE", f"/terminals/{name}")

    def close(self):
        if self.ws is not None:
            self.ws.close()


# --- what another user can reach of a learner's sockets ---

def _sockets(pid):
    """Inodes of the sockets pid holds."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        pass
    return inodes


def _endpoints_of(pid):
    """The TCP listeners ((family, port)) and Unix socket paths (abstract names start with @)
    that pid holds, read as root from /proc/<pid>/net: in pid's own network namespace."""
    inodes, tcp, unix = _sockets(pid), set(), set()
    for family, name in ((socket.AF_INET, "tcp"), (socket.AF_INET6, "tcp6")):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for f in (line.split() for line in lines):
            if f[3] == "0A" and f[9] in inodes:      # LISTEN, held by pid
                tcp.add((family, int(f[1].rsplit(":", 1)[1], 16)))
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        lines = []
    unix = {f[7] for f in (line.split() for line in lines) if len(f) > 7 and f[6] in inodes}
    return tcp, unix


def endpoints(uid):
    """Every TCP listener and Unix socket path of uid's course processes (warm processes, runs,
    live worlds), as root sees them: the addresses another user would need. The learner's
    Jupyter server and kernels are left out: their ports are Jupyter's, guarded by its tokens."""
    tcp, unix = set(), set()
    for p in user_processes(uid):
        try:
            args = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "ddp_lesson" in args and "ipykernel" not in args and "jupyterhub" not in args:
            t, u = _endpoints_of(p.pid)
            tcp |= t
            unix |= u
    return {"tcp": sorted(tcp), "unix": sorted(unix)}


PROBE = r'''
"""Run as another learner: try every address of a learner's run and live world, and their run folder."""
import json, os, socket, sys
target = json.loads(sys.argv[1])
report = {"uid": os.getuid(), "tcp": {}, "unix": {}, "run_dir": {}}

def reach(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(address)
        return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()

for family, port in target["tcp"]:
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    got = reach(family, (host, port))
    if got == "connected" and port == target.get("store_port"):
        try:      # the rendezvous store: can its keys be listed?
            from datetime import timedelta
            from torch.distributed import TCPStore
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
            got = "listed " + ",".join(sorted(store.list_keys())[:3])
        except Exception as e:
            got = f"connected ({type(e).__name__} when listing)"
    report["tcp"][f"{host}:{port}"] = got
for path in target["unix"]:
    address = "\0" + path[1:] if path.startswith("@") else path
    report["unix"][path] = reach(socket.AF_UNIX, address)
for what in ("listdir", "config.json", "script.py"):
    try:
        if what == "listdir":
            os.listdir(target["run_dir"])
        else:
            open(os.path.join(target["run_dir"], what)).read(1)
        report["run_dir"][what] = "read"
    except OSError as e:
        report["run_dir"][what] = type(e).__name__
print(json.dumps(report))
'''


def probe_as(user, python, base, target):
    """Run PROBE as `user` (runuser) against `target` (endpoints() plus run_dir, store_port)."""
    script = Path(base) / "probe.py"
    if not script.exists():
        script.write_text(PROBE)
        script.chmod(0o644)
    out = subprocess.run(["runuser", "-u", user, "--", python, str(script), json.dumps(target)],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def reachable(report):
    """What the probe could reach or read: {what: how}."""
    got = {k: v for part in ("tcp", "unix") for k, v in report[part].items() if not v.endswith("Error")}
    got.update({f"run_dir {k}": v for k, v in report["run_dir"].items() if v == "read"})
    return got


def make_base():
    """A root-owned folder every user can search (0755), for the course environment."""
    base = Path(tempfile.mkdtemp(prefix="ddp-lesson-hubtest-"))
    base.chmod(0o755)
    return base


def memory(uid):
    """MiB of uid's processes by kind (the server, kernels, warm processes, the rest: run and
    world processes), read as root from /proc/<pid>/smaps_rollup: {kind: [pss, private]}. PSS
    splits shared pages (torch's libraries, also among learners) between the processes that map
    them; private pages are what each further learner adds."""
    kinds = {}
    for p in user_processes(uid):
        try:
            args = " ".join(p.cmdline())
            parent = " ".join(psutil.Process(p.ppid()).cmdline())
            rollup = Path(f"/proc/{p.pid}/smaps_rollup").read_text().splitlines()
        except (OSError, psutil.Error):
            continue
        kb = {k: sum(int(line.split()[1]) for line in rollup if line.startswith(k))
              for k in ("Pss:", "Private_")}
        kind = ("server" if "jupyterhub.singleuser" in args else "kernel" if "ipykernel" in args
                else "warm" if "ddp_lesson.rank.warm.server" in args and "ipykernel" in parent else "run")
        old = kinds.get(kind, [0, 0])
        kinds[kind] = [old[0] + kb["Pss:"] / 1024, old[1] + kb["Private_"] / 1024]
    return {k: [round(v[0]), round(v[1])] for k, v in sorted(kinds.items())}
