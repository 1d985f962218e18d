//! Task metrics in containerd's formats, from libcgroups' statistics:
//! `io.containerd.cgroups.v1.Metrics` on v1 and v1-hybrid hosts (docker and
//! ctr read the memory and CPU figures the way they read runc's), and
//! `io.containerd.cgroups.v2.Metrics` on pure v2 hosts.

use std::collections::HashMap;

use containerd_shim::protos::cgroups::metrics as v1;
use containerd_shim::protos::cgroups_v2::metrics as v2;
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::{Message, MessageField};
use libcgroups::stats::{BlkioDeviceStat, MemoryData, Stats};

/// Encodes `stats` as containerd expects for the host's cgroup version.
pub fn to_any(stats: &Stats, unified: bool) -> Result<Any, containerd_shim::protos::protobuf::Error> {
    if unified {
        let m = to_v2(stats);
        return Ok(Any {
            type_url: "io.containerd.cgroups.v2.Metrics".to_owned(),
            value: m.write_to_bytes()?,
            ..Default::default()
        });
    }
    let m = to_v1(stats);
    Ok(Any {
        type_url: "io.containerd.cgroups.v1.Metrics".to_owned(),
        value: m.write_to_bytes()?,
        ..Default::default()
    })
}

/// The v1 metrics of `s`.
pub fn to_v1(s: &Stats) -> v1::Metrics {
    let stat = |k: &str| s.memory.stats.get(k).copied().unwrap_or(0);
    let cpu = v1::CPUStat {
        usage: MessageField::some(v1::CPUUsage {
            total: s.cpu.usage.usage_total,
            kernel: s.cpu.usage.usage_kernel,
            user: s.cpu.usage.usage_user,
            per_cpu: s.cpu.usage.per_core_usage_total.clone(),
            ..Default::default()
        }),
        throttling: MessageField::some(v1::Throttle {
            periods: s.cpu.throttling.periods,
            throttled_periods: s.cpu.throttling.throttled_periods,
            throttled_time: s.cpu.throttling.throttled_time,
            ..Default::default()
        }),
        ..Default::default()
    };
    let memory = v1::MemoryStat {
        cache: s.memory.cache,
        rss: stat("rss"),
        rss_huge: stat("rss_huge"),
        mapped_file: stat("mapped_file"),
        dirty: stat("dirty"),
        writeback: stat("writeback"),
        pg_pg_in: stat("pgpgin"),
        pg_pg_out: stat("pgpgout"),
        pg_fault: stat("pgfault"),
        pg_maj_fault: stat("pgmajfault"),
        inactive_anon: stat("inactive_anon"),
        active_anon: stat("active_anon"),
        inactive_file: stat("inactive_file"),
        active_file: stat("active_file"),
        unevictable: stat("unevictable"),
        hierarchical_memory_limit: stat("hierarchical_memory_limit"),
        hierarchical_swap_limit: stat("hierarchical_memsw_limit"),
        total_cache: stat("total_cache"),
        total_rss: stat("total_rss"),
        total_rss_huge: stat("total_rss_huge"),
        total_mapped_file: stat("total_mapped_file"),
        total_dirty: stat("total_dirty"),
        total_writeback: stat("total_writeback"),
        total_pg_pg_in: stat("total_pgpgin"),
        total_pg_pg_out: stat("total_pgpgout"),
        total_pg_fault: stat("total_pgfault"),
        total_pg_maj_fault: stat("total_pgmajfault"),
        total_inactive_anon: stat("total_inactive_anon"),
        total_active_anon: stat("total_active_anon"),
        total_inactive_file: stat("total_inactive_file"),
        total_active_file: stat("total_active_file"),
        total_unevictable: stat("total_unevictable"),
        usage: MessageField::some(entry(&s.memory.memory)),
        swap: MessageField::some(entry(&s.memory.memswap)),
        kernel: MessageField::some(entry(&s.memory.kernel)),
        kernel_tcp: MessageField::some(entry(&s.memory.kernel_tcp)),
        ..Default::default()
    };
    let blkio = v1::BlkIOStat {
        io_service_bytes_recursive: blkio(&s.blkio.service_bytes),
        io_serviced_recursive: blkio(&s.blkio.serviced),
        io_queued_recursive: blkio(&s.blkio.queued),
        io_service_time_recursive: blkio(&s.blkio.service_time),
        io_wait_time_recursive: blkio(&s.blkio.wait_time),
        io_merged_recursive: blkio(&s.blkio.merged),
        io_time_recursive: blkio(&s.blkio.time),
        sectors_recursive: blkio(&s.blkio.sectors),
        ..Default::default()
    };
    v1::Metrics {
        hugetlb: sorted(&s.hugetlb)
            .map(|(size, h)| v1::HugetlbStat {
                usage: h.usage,
                max: h.max_usage,
                failcnt: h.fail_count,
                pagesize: size.clone(),
                ..Default::default()
            })
            .collect(),
        pids: MessageField::some(v1::PidsStat {
            current: s.pids.current,
            limit: s.pids.limit,
            ..Default::default()
        }),
        cpu: MessageField::some(cpu),
        memory: MessageField::some(memory),
        blkio: MessageField::some(blkio),
        ..Default::default()
    }
}

/// The v2 metrics of `s` (libcgroups reports v2 CPU times in microseconds).
pub fn to_v2(s: &Stats) -> v2::Metrics {
    let stat = |k: &str| s.memory.stats.get(k).copied().unwrap_or(0);
    v2::Metrics {
        pids: MessageField::some(v2::PidsStat {
            current: s.pids.current,
            limit: s.pids.limit,
            ..Default::default()
        }),
        cpu: MessageField::some(v2::CPUStat {
            usage_usec: s.cpu.usage.usage_total,
            user_usec: s.cpu.usage.usage_user,
            system_usec: s.cpu.usage.usage_kernel,
            nr_periods: s.cpu.throttling.periods,
            nr_throttled: s.cpu.throttling.throttled_periods,
            throttled_usec: s.cpu.throttling.throttled_time,
            ..Default::default()
        }),
        memory: MessageField::some(v2::MemoryStat {
            anon: stat("anon"),
            file: stat("file"),
            kernel_stack: stat("kernel_stack"),
            slab: stat("slab"),
            sock: stat("sock"),
            shmem: stat("shmem"),
            file_mapped: stat("file_mapped"),
            file_dirty: stat("file_dirty"),
            file_writeback: stat("file_writeback"),
            inactive_anon: stat("inactive_anon"),
            active_anon: stat("active_anon"),
            inactive_file: stat("inactive_file"),
            active_file: stat("active_file"),
            unevictable: stat("unevictable"),
            pgfault: stat("pgfault"),
            pgmajfault: stat("pgmajfault"),
            usage: s.memory.memory.usage,
            usage_limit: s.memory.memory.limit,
            swap_usage: s.memory.memswap.usage,
            swap_limit: s.memory.memswap.limit,
            max_usage: s.memory.memory.max_usage,
            ..Default::default()
        }),
        hugetlb: sorted(&s.hugetlb)
            .map(|(size, h)| v2::HugeTlbStat {
                current: h.usage,
                max: h.max_usage,
                pagesize: size.clone(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn entry(d: &MemoryData) -> v1::MemoryEntry {
    v1::MemoryEntry {
        limit: d.limit,
        usage: d.usage,
        max: d.max_usage,
        failcnt: d.fail_count,
        ..Default::default()
    }
}

fn blkio(stats: &[BlkioDeviceStat]) -> Vec<v1::BlkIOEntry> {
    stats
        .iter()
        .map(|d| v1::BlkIOEntry {
            op: d.op_type.clone().unwrap_or_default(),
            major: d.major,
            minor: d.minor,
            value: d.value,
            ..Default::default()
        })
        .collect()
}

fn sorted<V>(map: &HashMap<String, V>) -> impl Iterator<Item = (&String, &V)> {
    let mut v: Vec<_> = map.iter().collect();
    v.sort_by(|a, b| a.0.cmp(b.0));
    v.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_carries_cpu_memory_pids() {
        let mut s = Stats::default();
        s.cpu.usage.usage_total = 1_000_000;
        s.cpu.usage.per_core_usage_total = vec![600_000, 400_000];
        s.memory.memory.usage = 4096;
        s.memory.memory.limit = 8192;
        s.memory.cache = 512;
        s.memory.stats.insert("total_inactive_file".into(), 100);
        s.pids.current = 3;
        let m = to_v1(&s);
        assert_eq!(m.cpu.usage.total, 1_000_000);
        assert_eq!(m.cpu.usage.per_cpu, vec![600_000, 400_000]);
        assert_eq!(m.memory.usage.usage, 4096);
        assert_eq!(m.memory.usage.limit, 8192);
        assert_eq!(m.memory.cache, 512);
        assert_eq!(m.memory.total_inactive_file, 100);
        assert_eq!(m.pids.current, 3);
        let any = to_any(&s, false).unwrap();
        assert_eq!(any.type_url, "io.containerd.cgroups.v1.Metrics");
        assert_eq!(v1::Metrics::parse_from_bytes(&any.value).unwrap(), m);
    }

    #[test]
    fn v2_carries_cpu_memory_pids() {
        let mut s = Stats::default();
        s.cpu.usage.usage_total = 77;
        s.memory.memory.usage = 4096;
        s.pids.limit = 10;
        let m = to_v2(&s);
        assert_eq!((m.cpu.usage_usec, m.memory.usage, m.pids.limit), (77, 4096, 10));
        assert_eq!(
            to_any(&s, true).unwrap().type_url,
            "io.containerd.cgroups.v2.Metrics"
        );
    }
}
