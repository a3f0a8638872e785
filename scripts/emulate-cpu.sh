#!/usr/bin/env bash
# scripts/emulate-cpu.sh — run an x86-64 Linux user program on an emulated CPU
# with AVX-512 + AVX512_VNNI (Bochs), for testing SIMD kernels on a machine
# whose own CPU lacks those instructions.
#
# Usage:
#   scripts/emulate-cpu.sh [--cpu MODEL] [--cpuid OPTS] [--timeout SECONDS]
#                          [--memory MB] [--ips N] [--keep DIR] [--no-strip]
#                          [--timestamps] [-e NAME=VALUE]... -- BINARY [ARGS...]
#
#   --cpu MODEL      Bochs CPU model (default: tigerlake, which has AVX-512
#                    F/CD/DQ/BW/VL/IFMA/VBMI/VBMI2/BITALG/VPOPCNTDQ/VNNI;
#                    corei7_icelake_u also has VNNI, corei7_skylake_x has
#                    AVX-512 without VNNI, corei7_haswell_4770 is AVX2 only;
#                    see `bochs --help cpu`). bx_generic takes --cpuid.
#                    No model of Debian's Bochs 2.7 has AVX-VNNI (the VEX
#                    form of VPDPBUSD): it raises #UD, and 2.7's `cpuid:`
#                    has no avx_vnni (nor avx512vnni) option.
#   --cpuid OPTS     extra `cpuid:` line for --cpu bx_generic, e.g.
#                    'simd=avx512, xsave=1, xsaveopt=1, avx_fma=1, bmi=2'.
#   --timeout SECS   wall-clock limit for boot + program (default 3600);
#                    on expiry Bochs is killed and the script exits 124.
#   --memory MB      guest RAM (default 2048).
#   --ips N          Bochs instructions-per-second calibration (default
#                    100000000); only scales guest time, not speed.
#   --keep DIR       keep the work files (bochsrc, ISO, initramfs, serial
#                    log, bochs log) in DIR instead of a temp directory.
#   --no-strip       keep BINARY's debug info (by default the guest copy is
#                    stripped with `strip --strip-debug`: smaller, boots faster).
#   --timestamps     prefix each line of the program's output with the wall
#                    time since it started, "[  12.5s] " (to 0.5 s: the serial
#                    log is polled), to see how long each test takes.
#   -e NAME=VALUE    export NAME=VALUE in the guest before running BINARY
#                    (repeatable), e.g. -e RUST_TEST_THREADS=1.
#
# Environment: STRATA_EMULATE_KERNEL (Debian kernel meta package, default
# linux-image-6.12-cloud-amd64), STRATA_EMULATE_CMDLINE (extra kernel args).
#
# BINARY is any x86-64 Linux user program, static or dynamically linked
# (glibc): it is packed into an initramfs with the libraries `ldd` lists,
# busybox-static and an /init that runs it; a Debian cloud kernel boots that
# from an isolinux ISO under Bochs, headless, serial console to a file. The
# program's output (stdout and stderr, via the serial console) is printed on
# stdout, followed by nothing else; the script exits with the program's exit
# status (124 on timeout, 125 if the guest died before the program ended).
# Progress and timings go to stderr as "[emulate-cpu] ..." lines.
#
# Needs root for apt-get the first time (bochs bochsbios vgabios
# busybox-static isolinux syslinux-common xorriso cpio, and a kernel .deb
# that is only extracted, never installed). Kernel and other downloads are
# cached under ${XDG_CACHE_HOME:-$HOME/.cache}/strata-emulate.
#
# Speed: Bochs interprets every instruction (tens of MIPS): boot to /init is
# about a minute; see docs/development.md for measured timings. The binary
# sees `/opt/prog` as its working directory and reads no host files.
#
# Example:
#   gcc -O2 -o /tmp/probe scripts/emulate-cpu/probe.c
#   scripts/emulate-cpu.sh -- /tmp/probe
#   scripts/emulate-cpu.sh -e RUST_TEST_THREADS=1 -- \
#       target/debug/deps/strata_engine-HASH backend::cpu::simd --test-threads 1
set -euo pipefail

me=emulate-cpu
log() { printf '[%s] %s\n' "$me" "$*" >&2; }
die() { log "error: $*"; exit 2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

cpu=tigerlake
cpuid_opts=""
timeout_s=3600
memory_mb=2048
ips=100000000
keep=""
strip=1
stamps=0
envs=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cpu) cpu=${2:?--cpu needs a model}; shift 2 ;;
        --cpuid) cpuid_opts=${2:?--cpuid needs options}; shift 2 ;;
        --timeout) timeout_s=${2:?--timeout needs seconds}; shift 2 ;;
        --memory) memory_mb=${2:?--memory needs MB}; shift 2 ;;
        --ips) ips=${2:?--ips needs a number}; shift 2 ;;
        --keep) keep=${2:?--keep needs a directory}; shift 2 ;;
        --no-strip) strip=0; shift ;;
        --timestamps) stamps=1; shift ;;
        -e) envs+=("${2:?-e needs NAME=VALUE}"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        -*) usage >&2; die "unknown option $1" ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || { usage >&2; die "no BINARY given"; }
binary=$1; shift
[[ -f $binary && -x $binary ]] || die "$binary is not an executable file"
[[ $timeout_s =~ ^[0-9]+$ ]] || die "--timeout must be a whole number of seconds"
[[ $memory_mb =~ ^[0-9]+$ ]] || die "--memory must be a number of MB"
[[ $ips =~ ^[0-9]+$ ]] || die "--ips must be a number"
for kv in "${envs[@]}"; do
    [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "-e wants NAME=VALUE, got '$kv'"
done

cache=${XDG_CACHE_HOME:-$HOME/.cache}/strata-emulate
mkdir -p "$cache"

# ---------------------------------------------------------------- packages
need_pkgs=()
[[ -x /usr/bin/bochs ]] || need_pkgs+=(bochs)
[[ -f /usr/share/bochs/BIOS-bochs-latest ]] || need_pkgs+=(bochsbios)
[[ -f /usr/share/vgabios/vgabios.bin ]] || need_pkgs+=(vgabios)
if ! file -L /bin/busybox 2>/dev/null | grep -q 'statically linked'; then
    need_pkgs+=(busybox-static)
fi
[[ -f /usr/lib/ISOLINUX/isolinux.bin ]] || need_pkgs+=(isolinux)
[[ -f /usr/lib/syslinux/modules/bios/ldlinux.c32 ]] || need_pkgs+=(syslinux-common)
command -v xorriso >/dev/null || need_pkgs+=(xorriso)
command -v cpio >/dev/null || need_pkgs+=(cpio)
command -v file >/dev/null || need_pkgs+=(file)
if [[ ${#need_pkgs[@]} -gt 0 ]]; then
    log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${need_pkgs[@]}" >&2 ||
        { apt-get update -qq >&2 && apt-get install -y -qq "${need_pkgs[@]}" >&2; } ||
        die "apt-get install ${need_pkgs[*]} failed"
fi
# Check the CPU model exists before building anything.
models=$(bochs --help cpu 2>&1 || true)
if ! grep -qx "$cpu" <<< "$models"; then
    die "bochs has no CPU model '$cpu' (see: bochs --help cpu)"
fi

# ------------------------------------------------------------------ kernel
# A Debian cloud kernel: small, with the 8250 serial console, devtmpfs and
# gzip initramfs built in, so no modules are needed. It has to be 6.12
# (bookworm's linux-image-6.12-cloud-amd64): bookworm's 6.1 kernel hangs under
# Bochs 2.7 right after "LSM: Security Framework initializing" (the CPU ends
# up executing data in .entry.text in an endless page-fault loop).
kernel_meta=${STRATA_EMULATE_KERNEL:-linux-image-6.12-cloud-amd64}
kernel=$cache/vmlinuz-$kernel_meta
resolve_kernel() {
    apt-cache depends "$kernel_meta" 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\)$/\1/p' | head -n1
}
if [[ ! -s $kernel ]]; then
    pkg=$(resolve_kernel)
    if [[ -z $pkg ]]; then
        apt-get update -qq >&2 || true
        pkg=$(resolve_kernel)
    fi
    [[ -n $pkg ]] || die "cannot resolve $kernel_meta to a kernel package"
    log "downloading kernel $pkg (once; cached in $cache)"
    dl=$(mktemp -d "$cache/kernel-dl.XXXXXX")
    (cd "$dl" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >&2) ||
        { rm -rf "$dl"; die "apt-get download $pkg failed"; }
    dpkg-deb -x "$dl"/*.deb "$dl/x"
    vmlinuz=$(find "$dl/x/boot" -name 'vmlinuz-*' | head -n1)
    [[ -n $vmlinuz ]] || { rm -rf "$dl"; die "no vmlinuz in $pkg"; }
    cp "$vmlinuz" "$kernel.tmp" && mv "$kernel.tmp" "$kernel"
    echo "$pkg" > "$kernel.package"
    rm -rf "$dl"
fi

# ------------------------------------------------------------ work folder
if [[ -n $keep ]]; then
    mkdir -p "$keep"
    work=$(cd "$keep" && pwd)
    rm -rf "$work/root" "$work/iso"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/strata-emulate.XXXXXX")
fi
bochs_pid=""
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    if [[ -n $bochs_pid ]] && kill -0 "$bochs_pid" 2>/dev/null; then
        kill "$bochs_pid" 2>/dev/null || true
        sleep 0.2
        kill -9 "$bochs_pid" 2>/dev/null || true
    fi
    if [[ -z $keep ]]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --------------------------------------------------------------- initramfs
root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,tmp,opt/prog,lib64,lib/x86_64-linux-gnu}
cp /bin/busybox "$root/bin/busybox"
for applet in sh mount umount cat grep echo poweroff sleep env ls uname; do
    ln -s busybox "$root/bin/$applet"
done
prog_name=$(basename "$binary")
cp -L "$binary" "$root/opt/prog/$prog_name"
# Debug info only makes the image bigger (and the guest slower to unpack it).
if [[ $strip == 1 ]] && command -v strip >/dev/null; then
    strip --strip-debug "$root/opt/prog/$prog_name" 2>/dev/null || true
fi
# Shared libraries (and the dynamic loader) at the paths ldd resolves them to.
if ldd_out=$(ldd "$binary" 2>/dev/null); then
    while read -r lib; do
        [[ -n $lib && -e $lib ]] || continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done < <(printf '%s\n' "$ldd_out" |
             sed -n -e 's/^.*=> \(\/[^ ]*\) (0x.*$/\1/p' -e 's/^[[:space:]]*\(\/[^ ]*\) (0x.*$/\1/p' |
             sort -u)
fi

# Quote a string for the guest's /bin/sh (busybox ash).
shq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
# shellcheck disable=SC2016  # these lines are for the guest's shell
{
    echo '#!/bin/sh'
    echo 'export PATH=/bin HOME=/tmp TMPDIR=/tmp'
    echo 'mount -t proc proc /proc'
    echo 'mount -t sysfs sysfs /sys'
    echo 'mount -t devtmpfs devtmpfs /dev'
    echo 'mount -t tmpfs tmpfs /tmp'
    echo 'read -r up _ < /proc/uptime'
    echo 'echo "STRATA-EMULATE-INIT uptime=$up"'
    echo 'grep -m1 "^model name" /proc/cpuinfo'
    echo 'grep -m1 "^flags" /proc/cpuinfo'
    for kv in "${envs[@]}"; do
        printf 'export %s=%s\n' "${kv%%=*}" "$(shq "${kv#*=}")"
    done
    echo 'cd /opt/prog'
    echo 'echo STRATA-EMULATE-START'
    printf './%s' "$(shq "$prog_name")"
    for a in "$@"; do printf ' %s' "$(shq "$a")"; done
    echo ' </dev/null 2>&1'
    echo 'rc=$?'
    echo 'read -r up _ < /proc/uptime'
    echo 'echo "STRATA-EMULATE-EXIT $rc uptime=$up"'
    # The console's tty buffer (a few KiB) drains at the UART's pace: powering off at once lost the tail of a
    # failing test's output and the marker with it (exit 125 instead of the program's 101).
    echo 'sleep 2'
    echo 'poweroff -f'
    echo 'sleep 5'
} > "$root/init"
chmod 755 "$root/init"

mkdir -p "$work/iso/isolinux"
(cd "$root" && find . -print0 | LC_ALL=C sort -z |
    cpio --null -o -H newc --quiet --owner=0:0) | gzip -1 > "$work/iso/initrd.gz"
rm -rf "$root"
cp "$kernel" "$work/iso/vmlinuz"
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 \
    "$work/iso/isolinux/"
# Work around Bochs 2.7 CPUID bugs the kernel trips over:
#  - PKRU is in the XCR0 mask of CPUID 0xD but its sub-leaf 9 says 0 bytes,
#    and CPUID(0xD,1).EBX gives the standard, not the compacted, XSAVE size:
#    the kernel then disables XSAVE altogether (no AVX at all in user space).
#    Without PKU and XSAVES/XSAVEC it uses the standard format: x87, SSE,
#    AVX, opmask, ZMM_Hi256, Hi16_ZMM (XCR0=0xe7), which is what we want.
#  - nopcid: PCID is not needed, one less thing for the emulator to get right.
cmdline="console=ttyS0,115200 quiet loglevel=3 rdinit=/init panic=-1"
cmdline+=" clearcpuid=pku,ospke,xsaves,xsavec nopcid"
cmdline+=" mitigations=off nokaslr tsc=reliable no_timer_check nowatchdog"
cmdline+=" random.trust_cpu=on audit=0 noresume"
if [[ -n ${STRATA_EMULATE_CMDLINE:-} ]]; then cmdline+=" $STRATA_EMULATE_CMDLINE"; fi
cat > "$work/iso/isolinux/isolinux.cfg" <<EOF
DEFAULT strata
PROMPT 0
TIMEOUT 0
LABEL strata
  KERNEL /vmlinuz
  INITRD /initrd.gz
  APPEND $cmdline
EOF
xorriso -as mkisofs -quiet -o "$work/boot.iso" -b isolinux/isolinux.bin \
    -c isolinux/boot.cat -no-emul-boot -boot-load-size 4 -boot-info-table \
    "$work/iso" 2>/dev/null
rm -rf "$work/iso"
log "image: $(du -h "$work/boot.iso" | cut -f1) ISO (kernel $(cat "$kernel.package" 2>/dev/null || echo "$kernel"), $prog_name + libs)"

# ------------------------------------------------------------------- bochs
serial=$work/serial.log
: > "$serial"
{
    echo "romimage: file=/usr/share/bochs/BIOS-bochs-latest"
    echo "vgaromimage: file=/usr/share/vgabios/vgabios.bin"
    # Debian's bochs has no nogui; rfb with timeout=0 runs without a client
    # (its VNC port is inside a private network namespace when unshare works).
    echo "display_library: rfb, options=\"timeout=0, hideIPS\""
    echo "config_interface: textconfig"
    echo "memory: guest=$memory_mb, host=$memory_mb"
    echo "cpu: model=$cpu, count=1, ips=$ips, reset_on_triple_fault=0, ignore_bad_msrs=1"
    if [[ -n $cpuid_opts ]]; then echo "cpuid: $cpuid_opts"; fi
    echo "clock: sync=none, time0=local"
    echo "ata0-master: type=cdrom, path=\"$work/boot.iso\", status=inserted"
    echo "boot: cdrom"
    echo "floppy_bootsig_check: disabled=1"
    echo "com1: enabled=1, mode=file, dev=\"$serial\""
    echo "log: \"$work/bochs.log\""
    echo "panic: action=fatal"
    echo "error: action=report"
    echo "info: action=ignore"
    echo "debug: action=ignore"
    echo "mouse: enabled=0"
    echo "private_colormap: enabled=0"
    # The ALSA mixer thread of Debian's bochs aborts (fortify) without a card.
    echo "sound: driver=dummy"
    echo "speaker: enabled=0"
} > "$work/bochsrc"

start=$(date +%s.%N)
log "booting on bochs cpu=$cpu (timeout ${timeout_s}s)"
# Debian's bochs is built with its debugger, which stops at a prompt before
# the first instruction: the -rc script continues. If the guest panics the
# debugger prompt reads EOF from /dev/null and bochs quits.
echo c > "$work/debugger.rc"
netns=()
if unshare -n true 2>/dev/null; then netns=(unshare -n); fi
"${netns[@]}" bochs -q -f "$work/bochsrc" -rc "$work/debugger.rc" \
    </dev/null >"$work/bochs.out" 2>&1 &
bochs_pid=$!

elapsed() { awk -v s="$start" -v n="$(date +%s.%N)" 'BEGIN { printf "%.1f", n - s }'; }

# Follow the serial log: print what the program writes (between the START
# and EXIT markers) as it arrives, note the timings, stop at the EXIT marker.
offset=0
state=boot       # boot -> running -> finished
rc=""
t_init="" t_start=""
deadline=$(( $(date +%s) + timeout_s ))
while :; do
    size=$(stat -c %s "$serial")
    if (( size > offset )); then
        chunk=$(tail -c +"$((offset + 1))" "$serial" | head -c "$((size - offset))")
        # Only consume complete lines; a partial last line waits for more.
        if [[ $chunk == *$'\n'* ]]; then
            complete=${chunk%$'\n'*}$'\n'
            offset=$(( offset + $(printf '%s' "$complete" | wc -c) ))
            while IFS= read -r line; do
                line=${line%$'\r'}
                case "$state:$line" in
                    boot:STRATA-EMULATE-INIT*)
                        t_init=$(elapsed)
                        log "boot to /init: ${t_init}s (guest ${line#*uptime=}s)" ;;
                    boot:"model name"*|boot:flags*)
                        log "guest $line" ;;
                    boot:STRATA-EMULATE-START)
                        t_start=$(elapsed); state=running ;;
                    running:STRATA-EMULATE-EXIT*)
                        rc=${line#STRATA-EMULATE-EXIT }; rc=${rc%% *}
                        state=finished; break ;;
                    running:*)
                        # The tty may interleave a kernel message; pass it on.
                        if [[ $stamps == 1 ]]; then
                            printf '[%7.1fs] %s\n' "$(awk -v a="$t_start" -v b="$(elapsed)" \
                                'BEGIN { print b - a }')" "$line"
                        else
                            printf '%s\n' "$line"
                        fi ;;
                    boot:*)
                        [[ -z $line ]] || log "guest: $line" ;;
                esac
            done <<< "${complete%$'\n'}"
        fi
    fi
    [[ $state == finished ]] && break
    if ! kill -0 "$bochs_pid" 2>/dev/null; then
        log "bochs exited before the program finished ($(elapsed)s); last lines of its output:"
        tail -n 15 "$work/bochs.out" >&2 || true
        grep -E '^[0-9]+[ep]\[' "$work/bochs.log" 2>/dev/null | tail -n 10 >&2 || true
        exit 125
    fi
    if (( $(date +%s) >= deadline )); then
        log "timeout after ${timeout_s}s (state: $state); killing bochs"
        exit 124
    fi
    sleep 0.5
done
t_end=$(elapsed)
log "program: $(awk -v a="$t_start" -v b="$t_end" 'BEGIN { printf "%.1f", b - a }')s, total ${t_end}s, exit status $rc"
[[ $rc =~ ^[0-9]+$ ]] || die "bad exit marker '$rc'"
exit "$rc"
