#!/bin/busybox sh
# /init of the TraCT test guest (an initramfs of busybox and kernel modules).
#
# Loads the CXL / nvdimm / dax / virtio-9p modules, mounts the host's / read-only
# over virtio-9p at /host, gives it a private /tmp, /dev/shm and /run, and runs
# $tract_script inside `chroot /host` with the host's own Python, project and
# cxl/ndctl/daxctl. Kernel command-line words `tract_*=...` arrive here as
# environment variables (the host driver, cxlvm.py, sets them). The last line
# on the console is "TRACT-VM-EXIT rc=N", which the driver waits for.
/bin/busybox mkdir -p /proc /sys /dev /host /keep /out
/bin/busybox mount -t proc proc /proc
/bin/busybox --install -s /bin
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

say() { echo "tract-vm: $*"; }
finish() {
    say "guest $tract_role: finished in $(cut -d' ' -f1 /proc/uptime) s of guest uptime"
    echo "TRACT-VM-EXIT rc=$1"
    sync
    poweroff -f
}

for m in $(cat /modules.order); do
    insmod "$m" 2>/dev/null || say "insmod $m failed"
done

mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /host \
    || { say "cannot mount the host's / over 9p"; finish 90; }
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /out \
    || { say "cannot mount the output folder over 9p"; finish 91; }

# host folders the guest must see that the private tmpfs below would cover
i=0
for p in $(echo "$tract_keep" | tr ':' ' '); do
    mkdir -p /keep/$i && mount --bind "/host$p" /keep/$i && i=$((i + 1))
done
mount --bind /dev /host/dev
mount --bind /proc /host/proc
mount --bind /sys /host/sys
mkdir -p /dev/shm
for d in /tmp /dev/shm /run; do mount -t tmpfs -o mode=1777 tmpfs "/host$d"; done
i=0
for p in $(echo "$tract_keep" | tr ':' ' '); do
    mkdir -p "/host$p" 2>/dev/null; mount --bind /keep/$i "/host$p" && i=$((i + 1))
done
mkdir -p "/host$tract_out" 2>/dev/null
mount --bind /out "/host$tract_out" || { say "cannot bind the output folder"; finish 92; }

say "guest $tract_role: ready after $(cut -d' ' -f1 /proc/uptime) s of guest uptime"
chroot /host /usr/bin/env -i PATH="$tract_path" HOME=/tmp TMPDIR=/tmp LANG=C.UTF-8 \
    TRACT_VM_ROLE="$tract_role" TRACT_VM_OUT="$tract_out" TRACT_VM_PROJECT="$tract_project" \
    COLUMNS=120 /bin/sh "$tract_script"
rc=$?
umount "/host$tract_out" 2>/dev/null
umount /out 2>/dev/null
finish $rc
