"""A real Kubernetes control plane on 127.0.0.1 for the `cluster` test tier.

Runs the binaries built by ``make k8s-bins`` (tests/k8s/build.sh) as local processes:

    etcd -> kube-apiserver -> kube-controller-manager + kube-scheduler + kwok

with a throw-away PKI (one CA signs the apiserver's serving cert and the admin client cert),
a service-account signing key, a static token file with an admin user, and RBAC on. kwok
(with the Stage configs in tests/k8s/kwok/stages.yaml) plays kubelet for fake nodes annotated
``kwok.x-k8s.io/node: fake`` that advertise ``nvidia.com/gpu: 8``. No traffic leaves loopback:
pods get fake IPs and nothing listens on them.

Everything lives in one work directory (``Cluster.workdir``): pki/, etcd data, kubeconfig, and
logs/<component>.log. ``start_cluster()`` returns a started ``Cluster``; ``Cluster.stop()``
terminates the processes and removes the work directory unless ``keep`` is true.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STAGES = HERE / "kwok" / "stages.yaml"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
)
FAKE_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"
SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.244.0.1/16"
NODE_IP = "10.1.0.1"


class ClusterError(RuntimeError):
    """The control plane could not be started (message names the component and its log)."""


class BinariesMissing(ClusterError):
    """The control-plane binaries have not been built."""


def versions() -> dict[str, str]:
    """The pinned component versions from tests/k8s/versions.env."""
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def cache_root() -> Path:
    return Path(os.environ.get("BATCHPILOT_CACHE") or Path.home() / ".cache" / "batchpilot")


def bin_dir() -> Path:
    """Where build.sh puts the binaries: $BATCHPILOT_CACHE/k8s/<K8S_VERSION>/bin."""
    return cache_root() / "k8s" / versions()["K8S_VERSION"] / "bin"


def gie_crd() -> Path:
    """The Gateway API Inference Extension's InferencePool CRD, as build.sh fetched it from
    the module at GIE_VERSION."""
    version = versions()["GIE_VERSION"]
    path = (
        bin_dir().parent
        / "crds"
        / f"gie-{version}"
        / "inference.networking.k8s.io_inferencepools.yaml"
    )
    if not path.is_file():
        raise BinariesMissing(f"GIE's InferencePool CRD missing: {path}; run `make k8s-bins`")
    return path


def find_binaries() -> dict[str, Path]:
    """Paths of all control-plane binaries; raises BinariesMissing naming the absent ones."""
    bdir = bin_dir()
    paths = {name: bdir / name for name in BINARIES}
    missing = [name for name, p in paths.items() if not os.access(p, os.X_OK)]
    if missing:
        raise BinariesMissing(
            f"Kubernetes test binaries missing from {bdir}: {', '.join(missing)}. "
            "Build them with `make k8s-bins` (runs tests/k8s/build.sh; needs Go and the Go "
            "module proxy; ~20 min cold, seconds when cached)."
        )
    return paths


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- PKI


@dataclass
class _Pki:
    dir: Path
    ca_crt: Path
    ca_key: Path
    serving_crt: Path
    serving_key: Path
    admin_crt: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _make_pki(pki_dir: Path) -> _Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=2)

    def write_key(path: Path, key: Any) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    def write_crt(path: Path, crt: x509.Certificate) -> None:
        path.write_bytes(crt.public_bytes(serialization.Encoding.PEM))

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("batchpilot-test-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(subject: x509.Name, usage: x509.ObjectIdentifier, sans: list[Any] | None = None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    service_ip = next(ipaddress.ip_network(SERVICE_CIDR).hosts())
    serving_key, serving = leaf(
        name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(service_ip),
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
        ],
    )
    admin_key, admin = leaf(name("admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pki = _Pki(
        dir=pki_dir,
        ca_crt=pki_dir / "ca.crt",
        ca_key=pki_dir / "ca.key",
        serving_crt=pki_dir / "apiserver.crt",
        serving_key=pki_dir / "apiserver.key",
        admin_crt=pki_dir / "admin.crt",
        admin_key=pki_dir / "admin.key",
        sa_key=pki_dir / "sa.key",
        sa_pub=pki_dir / "sa.pub",
    )
    write_crt(pki.ca_crt, ca)
    write_key(pki.ca_key, ca_key)
    write_crt(pki.serving_crt, serving)
    write_key(pki.serving_key, serving_key)
    write_crt(pki.admin_crt, admin)
    write_key(pki.admin_key, admin_key)
    write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


# --------------------------------------------------------------------------- processes


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as logf:
            logf.write(f"$ {' '.join(self.argv)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(5)


# --------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """A running loopback control plane. See ``start_cluster``.

    Stable interface (used by the `k8s` fixture and the operator's cluster tests):
      kubeconfig  path (str) of an admin kubeconfig (client cert in group system:masters)
      kubectl     path (str) of the kubectl binary
      helm        path (str) of the helm binary
      api         a ``kubernetes.client.ApiClient`` authenticated as that admin
      server      the apiserver URL, https://127.0.0.1:<port>
      token       a bearer token for the same admin (from the static token file)
      env         environment for subprocesses: KUBECONFIG and private HELM_* dirs set
      workdir     Path of the work directory; logs in workdir/"logs"
      node_names  names of the fake (kwok) nodes
      run_kubectl(*args, check=True, input=None, timeout=120) -> CompletedProcess[str]
      run_helm(*args, check=True, timeout=300) -> CompletedProcess[str]
      component(name).stop(), start_component(name), restart(name): one component
      stopped, started again with its flags, or both
    """

    workdir: Path
    bins: dict[str, Path]
    server: str
    kubeconfig: str
    token: str
    ca_file: str
    components: list[Component] = field(default_factory=list)
    node_names: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    keep: bool = False
    _api: Any = None

    @property
    def kubectl(self) -> str:
        return str(self.bins["kubectl"])

    @property
    def helm(self) -> str:
        return str(self.bins["helm"])

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def api(self) -> Any:
        if self._api is None:
            from kubernetes import config

            self._api = config.new_client_from_config(config_file=self.kubeconfig)
        return self._api

    def _run(self, argv: Sequence[str], check: bool, input: str | None, timeout: float):
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(
                proc.returncode, list(argv), output=proc.stdout, stderr=proc.stderr
            )
        return proc

    def run_kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises CalledProcessError (with stderr) if check."""
        return self._run(
            [self.kubectl, "--kubeconfig", self.kubeconfig, *args], check, input, timeout
        )

    def run_helm(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster (private HELM_* cache/config/data dirs)."""
        return self._run([self.helm, "--kubeconfig", self.kubeconfig, *args], check, None, timeout)

    def request(self, path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
        """A raw authenticated HTTPS request to the apiserver (status, parsed JSON or text)."""
        return _https(self.server + path, self.ca_file, self.token, method=method, body=body)

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def start_component(self, name: str, timeout: float = 60) -> None:
        """Start a stopped component again with its flags (its state is in etcd); after
        kube-apiserver, wait until it is ready."""
        comp = self.component(name)
        comp.start(self.env)
        if name == "kube-apiserver":
            _wait_for("kube-apiserver /readyz", lambda: self.request("/readyz")[0] == 200,
                      timeout, [comp])  # fmt: skip

    def restart(self, name: str, timeout: float = 60) -> None:
        """Stop one component (SIGTERM) and start it again."""
        self.component(name).stop()
        self.start_component(name, timeout)

    def stop(self) -> None:
        """Terminate every component (SIGTERM, then SIGKILL) and, unless `keep`, remove the
        work directory. Safe to call more than once."""
        for comp in reversed(self.components):
            comp.stop()
        if self._api is not None:
            with contextlib.suppress(Exception):
                self._api.close()
            self._api = None
        atexit.unregister(self.stop)
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _https(
    url: str,
    ca_file: str | None,
    token: str | None,
    method: str = "GET",
    body: Any = None,
    timeout: float = 5,
) -> tuple[int, Any]:
    if ca_file:
        ctx = ssl.create_default_context(cafile=ca_file)
    else:  # the component's own self-signed serving cert
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    # Never through a proxy: everything here is on loopback.
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
    )
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    watch: Sequence[Component],
    interval: float = 0.2,
) -> None:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        for comp in watch:
            if not comp.alive():
                code = comp.proc.returncode if comp.proc else None
                raise ClusterError(
                    f"{comp.name} exited (code {code}) while waiting for {what}; "
                    f"log {comp.log}:\n{comp.tail()}"
                )
        try:
            if check():
                return
        except Exception as e:  # not up yet
            last_exc = e
        time.sleep(interval)
    logs = "\n".join(f"--- {c.name} ({c.log}):\n{c.tail(10)}" for c in watch)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what} ({last_exc!r})\n{logs}")


def _kubeconfig(path: Path, server: str, pki: _Pki) -> None:
    import base64

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "batchpilot-test",
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_crt)},
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_crt),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [
            {
                "name": "batchpilot-test",
                "context": {"cluster": "batchpilot-test", "user": "admin", "namespace": "default"},
            }
        ],
        "current-context": "batchpilot-test",
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    path.chmod(0o600)


def fake_node(name: str, gpus: int = 8) -> dict[str, Any]:
    """A Node object managed by kwok, advertising `gpus` nvidia.com/gpu."""
    resources = {
        "cpu": "32",
        "memory": "256Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION[0]: FAKE_NODE_ANNOTATION[1]},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def start_cluster(
    workdir: str | os.PathLike[str] | None = None,
    nodes: int = 1,
    gpus_per_node: int = 8,
    keep: bool = False,
    timeout: float = 90,
    client_qps: tuple[float, int] | None = None,
) -> Cluster:
    """Start etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok on loopback,
    register `nodes` fake GPU nodes, and wait until they are Ready. Raises BinariesMissing if
    `make k8s-bins` has not run, ClusterError (with the failing component's log) otherwise.
    ``client_qps``: (QPS, burst) of kube-controller-manager's and kube-scheduler's clients
    (--kube-api-qps, --kube-api-burst); None keeps their defaults (20/30 and 50/100)."""
    bins = find_binaries()
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="batchpilot-k8s-"))
    wd.mkdir(parents=True, exist_ok=True)
    logs = wd / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()

    pki = _make_pki(wd / "pki")
    token = uuid.uuid4().hex
    token_file = wd / "tokens.csv"
    token_file.write_text(f'{token},admin,admin-uid,"system:masters"\n')
    token_file.chmod(0o600)

    etcd_port, etcd_peer, api_port, kcm_port, sched_port, kwok_port = (
        free_port() for _ in range(6)
    )
    server = f"https://127.0.0.1:{api_port}"
    kubeconfig = wd / "kubeconfig"
    _kubeconfig(kubeconfig, server, pki)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "HELM_", "ETCD"))}
    env.update(
        KUBECONFIG=str(kubeconfig),
        HELM_CACHE_HOME=str(wd / "helm" / "cache"),
        HELM_CONFIG_HOME=str(wd / "helm" / "config"),
        HELM_DATA_HOME=str(wd / "helm" / "data"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    cluster = Cluster(
        workdir=wd,
        bins=bins,
        server=server,
        kubeconfig=str(kubeconfig),
        token=token,
        ca_file=str(pki.ca_crt),
        env=env,
        keep=keep,
    )

    def comp(name: str, *argv: str) -> Component:
        c = Component(name, [str(bins[name]), *argv], logs / f"{name}.log")
        cluster.components.append(c)
        c.start(env)
        return c

    # Safety net if the caller never reaches stop() (e.g. the interpreter exits early).
    atexit.register(cluster.stop)
    try:
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{etcd_peer}"
        etcd = comp(
            "etcd",
            "--name=default",
            f"--data-dir={wd / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--listen-metrics-urls=",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        )
        _wait_for(
            "etcd /health",
            lambda: _https(etcd_url + "/health", None, None)[1].get("health") == "true",
            30,
            [etcd],
        )

        apiserver = comp(
            "kube-apiserver",
            f"--etcd-servers={etcd_url}",
            f"--cert-dir={wd / 'pki'}",
            f"--tls-cert-file={pki.serving_crt}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_crt}",
            f"--secure-port={api_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # The `kubernetes` Service would get a loopback endpoint, which validation rejects.
            "--endpoint-reconciler-type=none",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--authorization-mode=RBAC",
            f"--token-auth-file={token_file}",
            f"--service-account-issuer={server}/",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--profiling=false",
            "--v=1",
        )
        _wait_for(
            "kube-apiserver /readyz",
            lambda: cluster.request("/readyz")[0] == 200,
            60,
            [etcd, apiserver],
        )

        common = [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1"]
        if client_qps is not None:
            qps, burst = client_qps
            common += [f"--kube-api-qps={qps:g}", f"--kube-api-burst={burst}"]
        kcm = comp(
            "kube-controller-manager",
            *common,
            f"--secure-port={kcm_port}",
            f"--cert-dir={wd / 'kcm'}",
            "--controllers=*",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Let the built-in signer issue certificates for CSR tests.
            f"--cluster-signing-cert-file={pki.ca_crt}",
            f"--cluster-signing-key-file={pki.ca_key}",
            "--profiling=false",
            "--v=1",
        )
        sched = comp(
            "kube-scheduler",
            *common,
            f"--secure-port={sched_port}",
            f"--cert-dir={wd / 'scheduler'}",
            "--profiling=false",
            "--v=1",
        )
        kwok = comp(
            "kwok",
            f"--kubeconfig={kubeconfig}",
            f"--config={STAGES}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=" + "=".join(FAKE_NODE_ANNOTATION),
            f"--node-ip={NODE_IP}",
            f"--cidr={POD_CIDR}",
            f"--server-address=127.0.0.1:{kwok_port}",
            "--node-lease-duration-seconds=40",
        )
        all_comps = [etcd, apiserver, kcm, sched, kwok]
        _wait_for(
            "kube-controller-manager /healthz",
            lambda: _https(f"https://127.0.0.1:{kcm_port}/healthz", None, None)[0] == 200,
            60,
            all_comps,
        )
        _wait_for(
            "kube-scheduler /healthz",
            lambda: _https(f"https://127.0.0.1:{sched_port}/healthz", None, None)[0] == 200,
            60,
            all_comps,
        )

        for i in range(nodes):
            node = fake_node(f"kwok-gpu-{i}", gpus_per_node)
            status, body = cluster.request("/api/v1/nodes", "POST", node)
            if status != 201:
                raise ClusterError(f"creating fake node {node['metadata']['name']}: {body}")
            cluster.node_names.append(node["metadata"]["name"])

        def nodes_ready() -> bool:
            for n in cluster.node_names:
                _, obj = cluster.request(f"/api/v1/nodes/{n}")
                conds = {
                    c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])
                }
                alloc = obj.get("status", {}).get("allocatable", {})
                if conds.get("Ready") != "True" or alloc.get(GPU_RESOURCE) != str(gpus_per_node):
                    return False
            return True

        _wait_for("fake nodes Ready (kwok)", nodes_ready, timeout, all_comps)
        # The service-account controller populates `default` once kube-controller-manager runs.
        _wait_for(
            "default ServiceAccount (kube-controller-manager)",
            lambda: cluster.request("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
            timeout,
            all_comps,
        )
    except ClusterError as e:
        cluster.keep = True
        cluster.stop()
        raise ClusterError(f"{e}\n(all component logs kept in {logs})") from None
    except BaseException:
        cluster.keep = True
        cluster.stop()
        raise
    (wd / "ready-seconds").write_text(f"{time.monotonic() - started:.1f}\n")
    return cluster
