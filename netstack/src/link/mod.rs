//! Link backends that carry RoCEv2 datagrams. `udp` is the default (kernel UDP sockets).

pub mod sys;
pub mod udp;
