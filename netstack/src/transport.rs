//! The transports of the protocol core ([`flexns_proto::transport`]: RC, Solar, pacing),
//! instantiated over netstack's registered memory ([`crate::mem::Region`]): the engine, verbs
//! and the simulator name these aliases.

pub use flexns_proto::transport::*;

use crate::mem::Region;

/// An outgoing RC packet whose payload lies in netstack's registered memory.
pub type TxPacket = flexns_proto::transport::TxPacket<Region>;
/// A piece of an outgoing packet's payload in netstack's registered memory.
pub type PayloadPart = flexns_proto::transport::PayloadPart<Region>;

/// The RC transport over netstack's registered memory.
pub mod rc {
    pub use flexns_proto::transport::rc::*;

    /// An RC QP whose work requests name netstack's registered memory.
    pub type RcQp = flexns_proto::transport::rc::RcQp<crate::mem::Region>;
}
