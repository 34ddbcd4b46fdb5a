// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// flexns testbed random loss: a tc clsact egress program that drops each IPv4 packet with
// probability LOSS_PPM / 1e6 (the kernel here has no netem). ARP and other non-IP frames pass,
// so neighbours still resolve. Dropped and passed packets are counted in the `loss_stats`
// array map (0: passed, 1: dropped).
//
// Build: clang -O2 -g -target bpf -I/usr/include/$(uname -m)-linux-gnu -DLOSS_PPM=10000 -c
// loss.bpf.c -o loss.o (deploy/testbed/ecmp.sh block --fault loss does it).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#ifndef LOSS_PPM
#define LOSS_PPM 10000
#endif

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 2);
    __type(key, __u32);
    __type(value, __u64);
} loss_stats SEC(".maps");

static __always_inline void count(__u32 k) {
    __u64 *v = bpf_map_lookup_elem(&loss_stats, &k);
    if (v)
        __sync_fetch_and_add(v, 1);
}

SEC("tc")
int drop_random(struct __sk_buff *skb) {
    if (skb->protocol != bpf_htons(ETH_P_IP))
        return TC_ACT_OK;
    if (bpf_get_prandom_u32() % 1000000 < LOSS_PPM) {
        count(1);
        return TC_ACT_SHOT;
    }
    count(0);
    return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
