#!/usr/bin/env bash
# test-deps.sh — install, when missing, the system packages some tests use
# (each of those tests skips, saying why, without them):
#   - chromium: the console's tests in a real browser (services/console,
#     chromedp);
#   - qemu-system-x86 and a distribution kernel: the VPS guest boot under
#     software emulation (agent/vps/libvirt);
#   - openssh-server (and openssh-client): real ssh through
#     `better-compute ssh` to an sshd on loopback (services/dev
#     TestTunnelOpenSSH);
#   - podman, runc and busybox-static: a real container engine given a
#     reservation's GPUs through the CDI spec bcd writes (agent/bcd
#     TestPodman_SeesExactlyTheBookedGPUs; runc where Debian's crun cannot
#     start a container, the image a static busybox; busybox-static
#     replaces the dynamic busybox package).
# Best effort, and only where it can: as root with apt-get (Debian). `make
# test` and .ci/run call it; TEST_DEPS=0 skips it.
set -uo pipefail

[[ "${TEST_DEPS:-1}" == 0 ]] && exit 0

want=()
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v qemu-system-x86_64 >/dev/null 2>&1 || want+=(qemu-system-x86)
ls /boot/vmlinuz-* >/dev/null 2>&1 || want+=(linux-image-amd64)
command -v podman >/dev/null 2>&1 || want+=(podman)
[[ -x /usr/sbin/sshd ]] || want+=(openssh-server)
command -v ssh >/dev/null 2>&1 || want+=(openssh-client)
command -v runc >/dev/null 2>&1 || [[ -x /usr/sbin/runc ]] || want+=(runc)
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || want+=(busybox-static)
[[ ${#want[@]} -eq 0 ]] && exit 0

if ! command -v apt-get >/dev/null 2>&1 || [[ "$(id -u)" != 0 ]]; then
	echo "test-deps: missing ${want[*]} (install them to run every test; the tests that need them skip)" >&2
	exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "test-deps: installing ${want[*]}"
apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null ||
	{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null; } ||
	echo "test-deps: could not install ${want[*]}; the tests that need them skip" >&2
exit 0
