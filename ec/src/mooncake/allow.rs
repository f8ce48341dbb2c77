//! Which hosts a producer may connect to for a push: an operator's list of host names, IP
//! addresses and CIDR blocks ([`ConsumerAllowList`]).
//!
//! A push connects to addresses that come from outside: the consumer a request names
//! (`consumer_zmq`), then what that consumer answers (its shards' control addresses, the
//! Mooncake session of each reservation, the data host of each handshake). vLLM's producer
//! connects to all of them; a producer given a list connects only to hosts on it.
//!
//! Hosts are matched as written in the address, with no DNS resolution: a host name matches a
//! host-name entry (ASCII case and one trailing dot aside), an IP literal matches an address
//! entry or a CIDR block (an IPv4-mapped IPv6 address as its IPv4 address). So `localhost` does
//! not match `127.0.0.1`, and a non-standard spelling of an IPv4 address that the system's
//! resolver would still accept (`127.1`, `0x7f000001`, `127.0.0.01`) matches nothing.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::transfer::split_host_port;

/// The longest host name (RFC 1035).
const MAX_HOST_NAME: usize = 253;
/// The longest label of a host name (RFC 1035).
const MAX_LABEL: usize = 63;
/// The prefix of IPv4-mapped IPv6 addresses (`::ffff:0:0/96`), in bits.
const MAPPED_PREFIX: u8 = 96;

/// The hosts a producer may connect to: host names, IP addresses and CIDR blocks.
///
/// ```
/// use iris_ec::mooncake::ConsumerAllowList;
///
/// let list = ConsumerAllowList::parse(["pd-host", "10.0.0.0/8", "fd00::/8"]).unwrap();
/// assert!(list.allows("PD-Host"));
/// assert!(list.allows("10.1.2.3"));
/// assert!(list.allows("::ffff:10.1.2.3"));
/// assert!(list.allows("fd12::7"));
/// assert!(!list.allows("pd-host.example"));
/// assert!(!list.allows("192.168.0.1"));
/// assert!(list.allows_address("tcp://10.0.0.7:15000"));
/// assert!(!list.allows_address("tcp://[fe80::1]:15000"));
///
/// let err = ConsumerAllowList::parse(["10.0.0.7:15000"]).unwrap_err();
/// assert!(err.to_string().contains("port"), "{err}");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerAllowList {
    entries: Vec<Entry>,
}

/// An entry that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllowListError {
    /// No entries at all.
    #[error("the list is empty: give at least one host name, IP address or CIDR block")]
    Empty,
    /// An empty entry (two separators in a row, or one at either end).
    #[error("an entry is empty")]
    EmptyEntry,
    /// An entry with a port: entries name hosts, and every port of an allowed host is allowed.
    #[error(
        "entry {entry:?} carries a port; entries name hosts only (every port of an allowed host is allowed): write {host:?}"
    )]
    Port {
        /// The entry as given.
        entry: String,
        /// The entry without its port.
        host: String,
    },
    /// An entry with a scheme or a path, as an address rather than a host.
    #[error(
        "entry {entry:?} is an address, not a host: write the host alone (a name, an IP address or a CIDR block such as 10.0.0.0/8)"
    )]
    NotAHost {
        /// The entry as given.
        entry: String,
    },
    /// A CIDR block whose address or prefix length does not parse.
    #[error("entry {entry:?} is not a CIDR block: {reason}")]
    BadBlock {
        /// The entry as given.
        entry: String,
        /// What is wrong.
        reason: String,
    },
    /// A CIDR block with bits set past its prefix (`10.0.0.1/8`): likely a typo.
    #[error("entry {entry:?} has bits set past its /{prefix} prefix: write {network}/{prefix}")]
    HostBits {
        /// The entry as given.
        entry: String,
        /// The block's network address.
        network: IpAddr,
        /// The prefix length.
        prefix: u8,
    },
    /// Neither an IP address in standard form nor a valid host name.
    #[error("entry {entry:?} is neither an IP address nor a host name: {reason}")]
    BadHost {
        /// The entry as given.
        entry: String,
        /// What is wrong.
        reason: &'static str,
    },
}

impl ConsumerAllowList {
    /// Parses `entries`: host names, IP addresses (IPv6 with or without brackets) and CIDR
    /// blocks, with no port.
    ///
    /// # Errors
    /// [`AllowListError`] naming the first entry that cannot be used, and why.
    pub fn parse<I, S>(entries: I) -> Result<Self, AllowListError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let entries = entries
            .into_iter()
            .map(|entry| Entry::parse(entry.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if entries.is_empty() {
            return Err(AllowListError::Empty);
        }
        Ok(Self { entries })
    }

    /// Whether `host` (as written in an address, IPv6 with or without brackets) is allowed.
    #[must_use]
    pub fn allows(&self, host: &str) -> bool {
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        match host.parse::<IpAddr>() {
            Ok(ip) => {
                let ip = ip.to_canonical();
                self.entries.iter().any(|entry| entry.contains(ip))
            }
            Err(_) => {
                let name = normal_name(host);
                self.entries
                    .iter()
                    .any(|entry| matches!(entry, Entry::Name(allowed) if *allowed == name))
            }
        }
    }

    /// Whether the host of `address` (`host:port` or `tcp://host:port`) is allowed; an address
    /// with no host and port is not.
    #[must_use]
    pub fn allows_address(&self, address: &str) -> bool {
        let rest = address.strip_prefix("tcp://").unwrap_or(address);
        split_host_port(rest).is_ok_and(|(host, _)| self.allows(&host))
    }
}

impl fmt::Display for ConsumerAllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, entry) in self.entries.iter().enumerate() {
            if index > 0 {
                f.write_str(",")?;
            }
            match entry {
                Entry::Name(name) => f.write_str(name)?,
                Entry::Address(ip) => write!(f, "{ip}")?,
                Entry::Block { network, prefix } => write!(f, "{network}/{prefix}")?,
            }
        }
        Ok(())
    }
}

/// One parsed entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A host name, lower case, without a trailing dot.
    Name(String),
    /// An address, canonical (an IPv4-mapped IPv6 address as IPv4).
    Address(IpAddr),
    /// A CIDR block: its network address (canonical, as [`Entry::Address`]) and prefix length.
    Block { network: IpAddr, prefix: u8 },
}

impl Entry {
    fn parse(raw: &str) -> Result<Self, AllowListError> {
        let entry = raw.trim();
        if entry.is_empty() {
            return Err(AllowListError::EmptyEntry);
        }
        if entry.contains("://") {
            return Err(AllowListError::NotAHost {
                entry: entry.to_owned(),
            });
        }
        if let Some((address, prefix)) = entry.split_once('/') {
            return Self::block(entry, address, prefix);
        }
        if let Some(ip) = parse_ip(entry) {
            return Ok(Self::Address(ip.to_canonical()));
        }
        if let Some(host) = port_stripped(entry) {
            return Err(AllowListError::Port {
                entry: entry.to_owned(),
                host: host.to_owned(),
            });
        }
        let bad = |reason| AllowListError::BadHost {
            entry: entry.to_owned(),
            reason,
        };
        let name = normal_name(entry);
        if name.is_empty() || name.len() > MAX_HOST_NAME {
            return Err(bad("a host name has 1 to 253 characters"));
        }
        let labels: Vec<&str> = name.split('.').collect();
        for label in &labels {
            if label.is_empty() || label.len() > MAX_LABEL {
                return Err(bad("each dot-separated label has 1 to 63 characters"));
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(bad(
                    "a host name has letters, digits, '-' and '_' only (no wildcards)",
                ));
            }
        }
        // A resolver reads `127.1`, `10.0.0.01` or `0x7f000001` as IPv4 addresses: as names
        // they would match hosts that are addresses without being compared as addresses.
        let last = labels.last().copied().unwrap_or_default();
        let numeric = last.bytes().all(|b| b.is_ascii_digit())
            || last
                .strip_prefix("0x")
                .is_some_and(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()));
        if numeric {
            return Err(bad(
                "it reads as an IPv4 address in a non-standard form; write the address as a.b.c.d",
            ));
        }
        Ok(Self::Name(name))
    }

    fn block(entry: &str, address: &str, prefix: &str) -> Result<Self, AllowListError> {
        let bad = |reason: String| AllowListError::BadBlock {
            entry: entry.to_owned(),
            reason,
        };
        if let Some((prefix, _)) = prefix.split_once(':') {
            return Err(AllowListError::Port {
                entry: entry.to_owned(),
                host: format!("{address}/{prefix}"),
            });
        }
        let ip =
            parse_ip(address).ok_or_else(|| bad(format!("{address:?} is not an IP address")))?;
        let max = match ip {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| bad(format!("the prefix length {prefix:?} is not 0 to {max}")))?;
        let network = masked(ip, prefix);
        if network != ip {
            return Err(AllowListError::HostBits {
                entry: entry.to_owned(),
                network,
                prefix,
            });
        }
        // Hosts are compared canonically: a block inside the IPv4-mapped range is that IPv4
        // block.
        if let IpAddr::V6(v6) = network
            && prefix >= MAPPED_PREFIX
            && let Some(v4) = v6.to_ipv4_mapped()
        {
            return Ok(Self::Block {
                network: IpAddr::V4(v4),
                prefix: prefix - MAPPED_PREFIX,
            });
        }
        Ok(Self::Block { network, prefix })
    }

    /// Whether `ip` (canonical) is this entry's address or inside its block.
    fn contains(&self, ip: IpAddr) -> bool {
        match self {
            Self::Name(_) => false,
            Self::Address(allowed) => *allowed == ip,
            Self::Block { network, prefix } => {
                let same_family = matches!(
                    (network, ip),
                    (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_))
                );
                same_family && masked(ip, *prefix) == *network
            }
        }
    }
}

/// An IP address in standard form, IPv6 optionally in brackets.
fn parse_ip(text: &str) -> Option<IpAddr> {
    let bare = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(text);
    bare.parse().ok()
}

/// The host of `text` when `text` is `host:port` (IPv6 in brackets), `None` otherwise.
fn port_stripped(text: &str) -> Option<&str> {
    let (host, port) = text.rsplit_once(':')?;
    let is_port = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
    let bracketed = host.starts_with('[') && host.ends_with(']');
    (is_port && !host.is_empty() && (bracketed || !host.contains(':'))).then_some(host)
}

/// A host name as compared: ASCII lower case, without one trailing dot.
fn normal_name(host: &str) -> String {
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

/// `ip` with the bits past `prefix` cleared (`prefix` at most the family's width).
fn masked(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> ConsumerAllowList {
        ConsumerAllowList::parse(entries).unwrap()
    }

    #[test]
    fn host_names_match_case_insensitively_and_as_written() {
        let allowed = list(&["PD-Host", "pd-1.example.com."]);
        for host in [
            "pd-host",
            "PD-HOST",
            "pd-host.",
            "pd-1.example.com",
            "Pd-1.Example.COM.",
        ] {
            assert!(allowed.allows(host), "{host}");
        }
        for host in [
            "pd-host.example.com",
            "example.com",
            "pd-hos",
            "xpd-host",
            "1.example.com",
            "",
            // No DNS: a name and an address never match each other.
            "127.0.0.1",
        ] {
            assert!(!allowed.allows(host), "{host}");
        }
        assert!(!list(&["127.0.0.1"]).allows("localhost"));
        assert!(!list(&["localhost"]).allows("127.0.0.1"));
        assert!(list(&["localhost"]).allows("localhost"));
    }

    #[test]
    fn addresses_match_as_addresses_whatever_their_spelling() {
        let allowed = list(&["10.0.0.7", "fd00::1", "[fd00::2]", "::ffff:192.168.1.1"]);
        for host in [
            "10.0.0.7",
            "::ffff:10.0.0.7",
            "[::ffff:10.0.0.7]",
            "::FFFF:a00:7",
            "fd00::1",
            "FD00:0:0:0:0:0:0:1",
            "[fd00::1]",
            "fd00:0000::0002",
            "192.168.1.1",
        ] {
            assert!(allowed.allows(host), "{host}");
        }
        for host in [
            "10.0.0.8",
            "fd00::3",
            // What a resolver would read as 10.0.0.7 is not compared as an address.
            "10.0.0.07",
            "10.7",
            "0x0a000007",
            "167772167",
            "fd00::1%eth0",
            // IPv4-compatible (not mapped) addresses are IPv6 addresses of their own.
            "::10.0.0.7",
        ] {
            assert!(!allowed.allows(host), "{host}");
        }
    }

    #[test]
    fn cidr_blocks_match_ip_literals_of_their_family() {
        let allowed = list(&["10.0.0.0/8", "192.168.4.0/22", "fd00::/8", "2001:db8::/32"]);
        for host in [
            "10.0.0.0",
            "10.255.255.255",
            "::ffff:10.1.2.3",
            "192.168.4.0",
            "192.168.7.255",
            "fd00::1",
            "fdff:ffff::1",
            "2001:db8:ffff::1",
        ] {
            assert!(allowed.allows(host), "{host}");
        }
        for host in [
            "11.0.0.0",
            "9.255.255.255",
            "192.168.8.0",
            "192.168.3.255",
            "fc00::1",
            "fe00::1",
            "2001:db9::1",
            "::a00:1",
            "ten.example",
        ] {
            assert!(!allowed.allows(host), "{host}");
        }
    }

    #[test]
    fn edge_prefixes_match_everything_or_one_address() {
        let any_v4 = list(&["0.0.0.0/0"]);
        assert!(any_v4.allows("1.2.3.4") && any_v4.allows("255.255.255.255"));
        assert!(any_v4.allows("::ffff:1.2.3.4"));
        assert!(!any_v4.allows("::1") && !any_v4.allows("pd-host"));
        let any_v6 = list(&["::/0"]);
        assert!(any_v6.allows("::1") && any_v6.allows("ffff::1"));
        assert!(!any_v6.allows("1.2.3.4"));

        let one_v4 = list(&["10.0.0.7/32"]);
        assert!(one_v4.allows("10.0.0.7"));
        assert!(!one_v4.allows("10.0.0.6") && !one_v4.allows("10.0.0.8"));
        let one_v6 = list(&["fd00::7/128"]);
        assert!(one_v6.allows("fd00::7"));
        assert!(!one_v6.allows("fd00::6") && !one_v6.allows("fd00::8"));
        let halves = list(&["128.0.0.0/1", "::/1"]);
        assert!(halves.allows("128.0.0.1") && !halves.allows("127.255.255.255"));
        assert!(halves.allows("7fff::1") && !halves.allows("8000::1"));

        // A block in the IPv4-mapped range is that IPv4 block.
        let mapped = list(&["::ffff:10.0.0.0/104"]);
        assert!(mapped.allows("10.9.9.9") && mapped.allows("::ffff:10.9.9.9"));
        assert!(!mapped.allows("11.0.0.1"));
    }

    #[test]
    fn addresses_with_ports_are_checked_by_their_host() {
        let allowed = list(&["10.0.0.0/8", "pd-host", "fd00::1"]);
        for address in [
            "tcp://10.0.0.7:15000",
            "10.0.0.7:15000",
            "tcp://PD-host:15000",
            "tcp://[fd00::1]:15000",
            "[::ffff:10.0.0.7]:1",
        ] {
            assert!(allowed.allows_address(address), "{address}");
        }
        for address in [
            "tcp://11.0.0.7:15000",
            "tcp://other:15000",
            "tcp://[fd00::2]:15000",
            "tcp://10.0.0.7",
            "10.0.0.7",
            ":15000",
            "",
        ] {
            assert!(!allowed.allows_address(address), "{address}");
        }
    }

    #[test]
    fn bad_entries_are_refused_naming_the_entry_and_the_problem() {
        let err = |entries: &[&str]| ConsumerAllowList::parse(entries).unwrap_err();
        assert_eq!(err(&[]), AllowListError::Empty);
        assert_eq!(err(&["pd-host", " "]), AllowListError::EmptyEntry);
        for (entry, host) in [
            ("10.0.0.7:15000", "10.0.0.7"),
            ("pd-host:15000", "pd-host"),
            ("[fd00::1]:15000", "[fd00::1]"),
            ("10.0.0.0/8:15000", "10.0.0.0/8"),
        ] {
            let error = err(&[entry]);
            assert_eq!(
                error,
                AllowListError::Port {
                    entry: entry.to_owned(),
                    host: host.to_owned()
                }
            );
            let message = error.to_string();
            assert!(
                message.contains(entry) && message.contains("port"),
                "{message}"
            );
        }
        // A bare IPv6 address whose last group is all digits is an address, not a port.
        assert!(list(&["fd00::1:5000"]).allows("fd00::1:5000"));
        for (entry, needle) in [
            ("tcp://10.0.0.7:15000", "not a host"),
            ("10.0.0.0/33", "prefix length \"33\" is not 0 to 32"),
            ("fd00::/129", "is not 0 to 128"),
            ("10.0.0.0/", "prefix length"),
            ("10.0.0.0/-1", "prefix length"),
            ("10.0.0/8", "not an IP address"),
            ("pd-host/8", "not an IP address"),
            ("10.0.0.1/8", "write 10.0.0.0/8"),
            ("fd00::1/8", "write fd00::/8"),
            ("*.example.com", "no wildcards"),
            ("pd host", "letters, digits"),
            ("a..b", "1 to 63"),
            ("127.1", "non-standard form"),
            ("10.0.0.07", "non-standard form"),
            ("0x7f000001", "non-standard form"),
            ("fe80::1%eth0", "letters, digits"),
        ] {
            let message = err(&[entry]).to_string();
            assert!(
                message.contains(&format!("{entry:?}")) && message.contains(needle),
                "{entry}: {message}"
            );
        }
        let long = format!("{}.example", "a".repeat(64));
        assert!(err(&[&long]).to_string().contains("1 to 63"));
    }

    #[test]
    fn the_list_prints_its_entries_canonically() {
        let allowed = list(&["PD-Host.", "::ffff:10.0.0.7", "[fd00::1]", "10.0.0.0/8"]);
        assert_eq!(allowed.to_string(), "pd-host,10.0.0.7,fd00::1,10.0.0.0/8");
    }
}
