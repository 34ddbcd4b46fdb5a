// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// flexns testbed switch: a tc clsact egress program for the bottleneck port of the dumbbell.
//
// The kernel here has no RED qdisc, so the program keeps a virtual copy of the shaped FIFO: a
// backlog drained at RATE_BPS since the previous packet, plus this packet's bytes, bounded by
// LIMIT (the bfifo's). With that backlog it
//   1. marks ECN CE with RED between KMIN and KMAX (probability up to PMAX_PERMILLE / 1000) on
//      ECN-capable packets (bpf_skb_ecn_set_ce fixes the IP checksum);
//   2. stamps one HPCC INT hop (queue bytes, port tx bytes, dequeue time, link rate) into flexns
//      data packets that carry an INT stack in their CC header: UDP to ROCE_PORT with UDP
//      checksum 0, BTH CC length 13 words, a SEND/WRITE opcode. The ICRC masks the CC header;
//   3. counts packets, bytes, marks, stamps and virtual drops, and a histogram of the backlog
//      each packet found (the queue distribution) in the `tb_stats` array map.
//
// Build: clang -O2 -g -target bpf -I/usr/include/$(uname -m)-linux-gnu -DRATE_BPS=... -c
// ecn_int.bpf.c -o ecn_int.o (deploy/testbed/dumbbell.sh does it).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#ifndef RATE_BPS
#define RATE_BPS 200000000ULL
#endif
#ifndef LIMIT
#define LIMIT 300000ULL
#endif
#ifndef KMIN
#define KMIN 10000ULL
#endif
#ifndef KMAX
#define KMAX 50000ULL
#endif
#ifndef PMAX_PERMILLE
#define PMAX_PERMILLE 200
#endif
#ifndef ROCE_PORT
#define ROCE_PORT 4791
#endif

#define HIST 128
#define INT_WORDS 13   /* 4-byte header + 3 hops of 16 bytes */
#define MAX_HOPS 3
#define BTH_LEN 12

struct vq {
	struct bpf_spin_lock lock;
	__u64 backlog;
	__u64 last_ns;
	__u64 tx_bytes;
};

struct stats {
	__u64 pkts;
	__u64 bytes;
	__u64 ect;
	__u64 marked;
	__u64 stamped;
	__u64 vdrops;
	__u64 max_backlog;
	__u64 hist[HIST];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct vq);
} tb_vq SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stats);
} tb_stats SEC(".maps");

SEC("tc")
int ecn_int(struct __sk_buff *skb)
{
	__u32 k = 0;
	struct vq *v = bpf_map_lookup_elem(&tb_vq, &k);
	struct stats *st = bpf_map_lookup_elem(&tb_stats, &k);
	if (!v || !st)
		return TC_ACT_OK;
	__u64 now = bpf_ktime_get_ns();
	__u64 len = skb->len;
	__u64 q, tx;
	int dropped = 0;

	bpf_spin_lock(&v->lock);
	if (v->last_ns) {
		__u64 drained = (now - v->last_ns) * RATE_BPS / 8000000000ULL;
		v->backlog = v->backlog > drained ? v->backlog - drained : 0;
	}
	v->last_ns = now;
	q = v->backlog;
	if (q + len > LIMIT) {
		dropped = 1; /* the bfifo drops it too */
	} else {
		v->backlog = q + len;
		v->tx_bytes += len;
	}
	tx = v->tx_bytes;
	bpf_spin_unlock(&v->lock);

	__sync_fetch_and_add(&st->pkts, 1);
	__sync_fetch_and_add(&st->bytes, len);
	if (dropped) {
		/* the virtual FIFO is an estimate: should the real bfifo still take the packet, it
		 * carries a full-queue INT record rather than none (HPCC reads "no record" as "no INT") */
		__sync_fetch_and_add(&st->vdrops, 1);
		q = LIMIT;
	}
	if (q > st->max_backlog)
		st->max_backlog = q;
	__u64 b = q * HIST / LIMIT;
	if (b >= HIST)
		b = HIST - 1;
	__sync_fetch_and_add(&st->hist[b & (HIST - 1)], 1);

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
		return TC_ACT_OK;
	if ((ip.tos & 3) != 0) {
		__sync_fetch_and_add(&st->ect, 1);
		int mark = q >= KMAX;
		if (!mark && q > KMIN)
			mark = (bpf_get_prandom_u32() % 1000) < PMAX_PERMILLE * (q - KMIN) / (KMAX - KMIN);
		if (mark && bpf_skb_ecn_set_ce(skb))
			__sync_fetch_and_add(&st->marked, 1);
	}

	if (ip.protocol != IPPROTO_UDP || ip.ihl != 5)
		return TC_ACT_OK;
	__u32 uoff = ETH_HLEN + sizeof(struct iphdr);
	struct udphdr udp;
	if (bpf_skb_load_bytes(skb, uoff, &udp, sizeof(udp)) < 0)
		return TC_ACT_OK;
	if (udp.dest != bpf_htons(ROCE_PORT) || udp.check != 0)
		return TC_ACT_OK;
	__u32 bth = uoff + sizeof(struct udphdr);
	__u8 hdr[5];
	if (bpf_skb_load_bytes(skb, bth, hdr, sizeof(hdr)) < 0)
		return TC_ACT_OK;
	/* SEND/WRITE requests (opcodes 0x00..0x0B) with an INT stack in the CC header */
	if (hdr[0] > 0x0B || (hdr[4] & 0x1F) != INT_WORDS)
		return TC_ACT_OK;
	__u8 nhop;
	if (bpf_skb_load_bytes(skb, bth + BTH_LEN, &nhop, 1) < 0 || nhop >= MAX_HOPS)
		return TC_ACT_OK;
	/* the packet leaves the FIFO after the backlog ahead of it: HPCC's dequeue time */
	__u32 rec[4] = {
		bpf_htonl((__u32)q),
		bpf_htonl((__u32)tx),
		bpf_htonl((__u32)(now + q * 8000000000ULL / RATE_BPS)),
		bpf_htonl((__u32)(RATE_BPS / 1000000)),
	};
	__u32 off = bth + BTH_LEN + 4 + (__u32)nhop * 16;
	if (bpf_skb_store_bytes(skb, off, rec, sizeof(rec), 0) < 0)
		return TC_ACT_OK;
	nhop += 1;
	if (bpf_skb_store_bytes(skb, bth + BTH_LEN, &nhop, 1, 0) == 0)
		__sync_fetch_and_add(&st->stamped, 1);
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
