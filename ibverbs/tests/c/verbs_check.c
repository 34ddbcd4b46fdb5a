/* Checks of flexns's libibverbs.so.1 through the real <infiniband/verbs.h> (ibverbs/tests/verbs_c.rs
 * compiles and runs it). "local": one process's refusals, states and events; "pair": two processes
 * (fork before any verb) moving a random pattern by SEND, INLINE SEND, RDMA WRITE and RDMA READ,
 * every byte checked, and a deregistration with a READ response in flight. Exit 0: all held. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define CHECK(c, ...) do { if (!(c)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)

static struct ibv_context *ctx;
static struct ibv_pd *pd;

static void open_dev(void) {
    int n;
    struct ibv_device **l = ibv_get_device_list(&n);
    CHECK(l && n == 1, "device list");
    ctx = ibv_open_device(l[0]);
    CHECK(ctx, "open device: %s", strerror(errno));
    ibv_free_device_list(l);
    pd = ibv_alloc_pd(ctx);
    CHECK(pd, "alloc pd");
}

static struct ibv_qp *make_qp(struct ibv_cq *scq, struct ibv_cq *rcq) {
    struct ibv_qp_init_attr a = {0};
    a.send_cq = scq; a.recv_cq = rcq; a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 64; a.cap.max_recv_wr = 64; a.cap.max_send_sge = 2; a.cap.max_recv_sge = 2;
    a.cap.max_inline_data = 256;
    struct ibv_qp *qp = ibv_create_qp(pd, &a);
    CHECK(qp, "create qp: %s", strerror(errno));
    struct ibv_qp_attr m = {0};
    m.qp_state = IBV_QPS_INIT; m.port_num = 1;
    m.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    CHECK(ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0, "INIT");
    return qp;
}

static int qp_state(struct ibv_qp *qp) {
    struct ibv_qp_attr a; struct ibv_qp_init_attr i;
    CHECK(ibv_query_qp(qp, &a, IBV_QP_STATE, &i) == 0, "query qp");
    return a.qp_state;
}

/* The next completion of `cq`, within 30 s. */
static struct ibv_wc poll1(struct ibv_cq *cq) {
    struct ibv_wc wc;
    time_t end = time(NULL) + 30;
    for (long i = 0;; i++) {
        int n = ibv_poll_cq(cq, 1, &wc);
        CHECK(n >= 0, "poll cq");
        if (n == 1) return wc;
        if (i % 1000 == 999) {
            CHECK(time(NULL) < end, "no completion within 30 s");
            usleep(50);
        }
    }
}

/* ---- local ---- */

static struct ibv_cq *ack_cq;
static volatile int acked;
static void *late_ack(void *arg) {
    (void)arg;
    usleep(300000);
    acked = 1;
    ibv_ack_cq_events(ack_cq, 1);
    return NULL;
}

/* Arms `cq`, makes one flushed completion on it through `qp` (in ERR) and waits until its
 * channel's fd is readable. */
static void one_event(struct ibv_comp_channel *ch, struct ibv_cq *cq, struct ibv_qp *qp) {
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "arm");
    struct ibv_recv_wr r = {0}, *bad;
    r.wr_id = 7;
    CHECK(ibv_post_recv(qp, &r, &bad) == 0, "post_recv on ERR");
    struct pollfd p = {ch->fd, POLLIN, 0};
    CHECK(poll(&p, 1, 5000) == 1, "no channel event");
}

static int local(void) {
    open_dev();
    long pg = sysconf(_SC_PAGESIZE);
    char *buf = malloc(4096);
    /* reg_mr: wrapping range, unmapped range, read-only range with writes, remote write without
     * local write */
    errno = 0;
    CHECK(!ibv_reg_mr(pd, (void *)(uintptr_t)(UINTPTR_MAX - 100), 4096, 0) && errno == EINVAL,
          "wrapping range: errno %d", errno);
    char *m = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED, "mmap");
    CHECK(munmap(m + 2 * pg, pg) == 0, "munmap");
    errno = 0;
    CHECK(!ibv_reg_mr(pd, m, 4 * pg, IBV_ACCESS_LOCAL_WRITE) && errno == EFAULT, "hole: errno %d", errno);
    struct ibv_mr *ok = ibv_reg_mr(pd, m, 2 * pg, IBV_ACCESS_LOCAL_WRITE);
    CHECK(ok, "mapped part: %s", strerror(errno));
    CHECK(ibv_dereg_mr(ok) == 0, "dereg");
    CHECK(mprotect(m, pg, PROT_READ) == 0, "mprotect");
    errno = 0;
    CHECK(!ibv_reg_mr(pd, m, pg, IBV_ACCESS_LOCAL_WRITE) && errno == EFAULT, "read-only: errno %d", errno);
    ok = ibv_reg_mr(pd, m, pg, IBV_ACCESS_REMOTE_READ);
    CHECK(ok, "read-only, read access: %s", strerror(errno));
    CHECK(ibv_dereg_mr(ok) == 0, "dereg");
    errno = 0;
    CHECK(!ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_REMOTE_WRITE) && errno == EINVAL,
          "REMOTE_WRITE without LOCAL_WRITE: errno %d", errno);

    /* EBUSY while in use */
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr, "reg");
    CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc_pd with an MR");
    struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
    CHECK(ch, "channel");
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_cq *ecq = ibv_create_cq(ctx, 16, (void *)0x1234, ch, 0);
    CHECK(cq && ecq, "cq");
    CHECK(ch->refcnt == 1, "channel refcnt %d", ch->refcnt);
    CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "destroy channel with a CQ");
    struct ibv_qp *qp = make_qp(cq, ecq);
    CHECK(ibv_destroy_cq(cq) == EBUSY, "destroy_cq with a QP");
    CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc_pd with a QP");

    /* ERR: posts are accepted and flushed; query_qp says ERR */
    struct ibv_qp_attr e = {0};
    e.qp_state = IBV_QPS_ERR;
    CHECK(ibv_modify_qp(qp, &e, IBV_QP_STATE) == 0, "to ERR");
    CHECK(qp_state(qp) == IBV_QPS_ERR, "query: %d", qp_state(qp));
    struct ibv_sge sge = {(uintptr_t)buf, 64, mr->lkey};
    struct ibv_send_wr s = {0}, *sbad = NULL;
    s.wr_id = 42; s.sg_list = &sge; s.num_sge = 1; s.opcode = IBV_WR_SEND; s.send_flags = IBV_SEND_SIGNALED;
    CHECK(ibv_post_send(qp, &s, &sbad) == 0, "post_send on ERR: refused");
    struct ibv_wc wc = poll1(cq);
    CHECK(wc.wr_id == 42 && wc.status == IBV_WC_WR_FLUSH_ERR, "send: wr_id %llu status %d",
          (unsigned long long)wc.wr_id, wc.status);

    /* a destroyed CQ's queued event is not handed out afterwards */
    one_event(ch, ecq, qp);
    CHECK(ibv_destroy_qp(qp) == 0, "destroy qp");
    CHECK(ibv_destroy_cq(ecq) == 0, "destroy cq with a queued event");
    CHECK(ch->refcnt == 0, "channel refcnt %d", ch->refcnt);
    struct ibv_cq *ecq2 = ibv_create_cq(ctx, 16, (void *)0x5678, ch, 0);
    CHECK(ecq2, "cq2");
    qp = make_qp(cq, ecq2);
    CHECK(ibv_modify_qp(qp, &e, IBV_QP_STATE) == 0, "to ERR");
    one_event(ch, ecq2, qp);
    struct ibv_cq *got; void *gctx;
    CHECK(ibv_get_cq_event(ch, &got, &gctx) == 0, "get event");
    CHECK(got == ecq2 && gctx == (void *)0x5678, "event of %p (ctx %p), not of the live CQ %p", (void *)got, gctx,
          (void *)ecq2);
    wc = poll1(ecq2);
    CHECK(wc.status == IBV_WC_WR_FLUSH_ERR, "recv status %d", wc.status);

    /* destroy waits for the acknowledgement of an event handed out */
    CHECK(ibv_destroy_qp(qp) == 0, "destroy qp");
    ack_cq = ecq2;
    pthread_t t;
    pthread_create(&t, NULL, late_ack, NULL);
    CHECK(ibv_destroy_cq(ecq2) == 0, "destroy cq");
    CHECK(acked, "ibv_destroy_cq returned before the event was acknowledged");
    pthread_join(t, NULL);

    CHECK(ibv_destroy_cq(cq) == 0, "destroy cq");
    CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy channel");
    CHECK(ibv_dereg_mr(mr) == 0, "dereg");
    CHECK(ibv_dealloc_pd(pd) == 0, "dealloc_pd");
    CHECK(ibv_close_device(ctx) == 0, "close");
    printf("local ok\n");
    return 0;
}

/* ---- pair ---- */

struct info { uint32_t qpn; uint8_t gid[16]; uint64_t addr; uint32_t rkey; };

static void xfer(int wfd, int rfd, const void *out, void *in, size_t n) {
    CHECK(write(wfd, out, n) == (ssize_t)n, "pipe write");
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(rfd, (char *)in + got, n - got);
        CHECK(r > 0, "pipe read: the other process is gone");
        got += r;
    }
}

static void sync_(int wfd, int rfd) { char c = 's', d; xfer(wfd, rfd, &c, &d, 1); }

static void connect_qp(struct ibv_qp *qp, const struct info *peer) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = peer->qpn; a.rq_psn = 1;
    a.max_dest_rd_atomic = 4; a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1; a.ah_attr.port_num = 1; a.ah_attr.grh.hop_limit = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0, "RTR");
    a.qp_state = IBV_QPS_RTS; a.sq_psn = 1; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.max_rd_atomic = 4;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) == 0, "RTS");
    CHECK(qp_state(qp) == IBV_QPS_RTS, "state %d", qp_state(qp));
}

static void fill(uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) { seed = seed * 1103515245u + 12345u; p[i] = seed >> 16; }
}
static void same(const uint8_t *got, size_t n, unsigned seed, const char *what) {
    uint8_t *want = malloc(n);
    fill(want, n, seed);
    for (size_t i = 0; i < n; i++)
        CHECK(got[i] == want[i], "%s: byte %zu is %02x, not %02x", what, i, got[i], want[i]);
    free(want);
}

static void post(struct ibv_qp *qp, int op, void *addr, uint32_t len, uint32_t lkey, int flags,
                 uint64_t raddr, uint32_t rkey) {
    struct ibv_sge sge = {(uintptr_t)addr, len, lkey};
    struct ibv_send_wr w, *bad = NULL;
    memset(&w, 0xa5, sizeof w); /* garbage in every field and padding the request does not use */
    w.wr_id = op; w.next = NULL; w.sg_list = &sge; w.num_sge = 1; w.opcode = op;
    w.send_flags = IBV_SEND_SIGNALED | flags; w.imm_data = 0;
    w.wr.rdma.remote_addr = raddr; w.wr.rdma.rkey = rkey;
    int r = ibv_post_send(qp, &w, &bad);
    CHECK(r == 0, "post_send op %d: %d", op, r);
}

static void post_recv(struct ibv_qp *qp, void *addr, uint32_t len, uint32_t lkey) {
    struct ibv_sge sge = {(uintptr_t)addr, len, lkey};
    struct ibv_recv_wr w = {0}, *bad;
    w.sg_list = &sge; w.num_sge = 1;
    CHECK(ibv_post_recv(qp, &w, &bad) == 0, "post_recv");
}

#define SZ (1 << 20)
#define BIG (48 << 20)

static int pair(void) {
    int a2b[2], b2a[2];
    signal(SIGPIPE, SIG_IGN); /* a write to a process that is gone fails instead */
    CHECK(pipe(a2b) == 0 && pipe(b2a) == 0, "pipe");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    int is_a = pid != 0;
    int wfd = is_a ? a2b[1] : b2a[1], rfd = is_a ? b2a[0] : a2b[0];
    /* only the ends this side uses stay open: the other side's exit is an EOF here */
    close(is_a ? a2b[0] : b2a[0]);
    close(is_a ? b2a[1] : a2b[1]);
    open_dev();
    struct ibv_cq *cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
    CHECK(cq, "cq");
    struct ibv_qp *qp = make_qp(cq, cq);
    size_t len = SZ + BIG;
    uint8_t *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(buf != MAP_FAILED, "mmap");
    int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, SZ, acc);
    struct ibv_mr *big = ibv_reg_mr(pd, buf + SZ, BIG, acc);
    CHECK(mr && big, "reg");
    uint8_t *inl = buf + SZ; /* the INLINE message's receive buffer (in `big`) */
    if (!is_a) {
        memset(buf, 0, SZ);
        post_recv(qp, buf, SZ, mr->lkey);
        post_recv(qp, inl, 4096, big->lkey);
    }
    struct info me = {0}, peer;
    me.qpn = qp->qp_num;
    CHECK(ibv_query_gid(ctx, 1, 0, (union ibv_gid *)me.gid) == 0, "gid");
    me.addr = (uintptr_t)buf; me.rkey = mr->rkey;
    xfer(wfd, rfd, &me, &peer, sizeof me);
    connect_qp(qp, &peer);
    sync_(wfd, rfd);
    if (is_a) {
        /* SEND of a pattern; an INLINE SEND from unregistered memory (lkey 0); an RDMA WRITE */
        fill(buf, SZ, 1);
        post(qp, IBV_WR_SEND, buf, SZ, mr->lkey, 0, 0, 0);
        CHECK(poll1(cq).status == IBV_WC_SUCCESS, "send");
        uint8_t small[200];
        fill(small, sizeof small, 2);
        post(qp, IBV_WR_SEND, small, sizeof small, 0, IBV_SEND_INLINE, 0, 0);
        memset(small, 0, sizeof small); /* copied at post time */
        struct ibv_wc wc = poll1(cq);
        CHECK(wc.status == IBV_WC_SUCCESS, "inline send: status %d", wc.status);
        sync_(wfd, rfd); /* B checked both messages: its buffer may be written */
        fill(buf, SZ, 3);
        post(qp, IBV_WR_RDMA_WRITE, buf, SZ, mr->lkey, 0, peer.addr, peer.rkey);
        CHECK(poll1(cq).status == IBV_WC_SUCCESS, "write");
        sync_(wfd, rfd); /* B checks the WRITE */
        sync_(wfd, rfd); /* B filled its buffer with pattern 4 */
        memset(buf, 0, SZ);
        post(qp, IBV_WR_RDMA_READ, buf, SZ, mr->lkey, 0, peer.addr, peer.rkey);
        CHECK(poll1(cq).status == IBV_WC_SUCCESS, "read");
        same(buf, SZ, 4, "READ");
        /* a big READ; B deregisters and unmaps its memory while the response is under way */
        struct info bb;
        xfer(wfd, rfd, &me, &bb, sizeof bb);
        post(qp, IBV_WR_RDMA_READ, buf + SZ, BIG, big->lkey, 0, bb.addr, bb.rkey);
        sync_(wfd, rfd);
        wc = poll1(cq);
        char c = 's', d;
        if (write(wfd, &c, 1) != 1 || read(rfd, &d, 1) != 1) {
            int st = 0;
            waitpid(pid, &st, 0);
            CHECK(0, "B is gone (wait status %#x, signal %d) after the big READ (status %d)", st,
                  WIFSIGNALED(st) ? WTERMSIG(st) : 0, wc.status);
        }
        fprintf(stderr, "big READ status %d\n", wc.status);
        /* a READ that failed (B's region went away under a retransmitted request) moved the
         * QP to ERR in the engine: ibv_query_qp says so */
        if (wc.status != IBV_WC_SUCCESS)
            CHECK(qp_state(qp) == IBV_QPS_ERR, "after a failed READ the QP is in %d, not ERR", qp_state(qp));
        int st;
        CHECK(waitpid(pid, &st, 0) == pid, "wait");
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "B: status %#x", st);
    } else {
        struct ibv_wc wc = poll1(cq);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == SZ, "recv: %d %u", wc.status, wc.byte_len);
        same(buf, SZ, 1, "SEND");
        wc = poll1(cq);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 200, "inline recv: %d %u", wc.status, wc.byte_len);
        same(inl, 200, 2, "INLINE SEND");
        sync_(wfd, rfd);
        sync_(wfd, rfd);
        same(buf, SZ, 3, "RDMA WRITE");
        fill(buf, SZ, 4);
        sync_(wfd, rfd);
        fill(buf + SZ, BIG, 5);
        struct info bb = me;
        bb.addr = (uintptr_t)(buf + SZ); bb.rkey = big->rkey;
        struct info ignored;
        xfer(wfd, rfd, &bb, &ignored, sizeof bb);
        sync_(wfd, rfd); /* A posted the READ */
        usleep(20000);
        CHECK(ibv_dereg_mr(big) == 0, "dereg during a READ");
        CHECK(munmap(buf + SZ, BIG) == 0, "munmap");
        /* keep the engine running for A's READ */
        struct ibv_wc none;
        for (int i = 0; i < 2000; i++) { ibv_poll_cq(cq, 1, &none); usleep(500); }
        sync_(wfd, rfd);
    }
    CHECK(ibv_destroy_qp(qp) == 0, "destroy qp");
    CHECK(ibv_dereg_mr(mr) == 0, "dereg");
    if (is_a) CHECK(ibv_dereg_mr(big) == 0, "dereg");
    CHECK(ibv_destroy_cq(cq) == 0, "destroy cq");
    CHECK(ibv_dealloc_pd(pd) == 0, "dealloc");
    CHECK(ibv_close_device(ctx) == 0, "close");
    printf("%s ok\n", is_a ? "pair" : "B");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "local")) return local();
    if (argc == 2 && !strcmp(argv[1], "pair")) return pair();
    fprintf(stderr, "usage: %s local|pair\n", argv[0]);
    return 2;
}
