//! Separate "hosts" on one machine: a Linux bridge in the root network namespace and one network namespace per
//! worker, joined to it by a veth pair, each with its own address on a private /24. Processes started through
//! [`Network::command`] run inside a namespace; [`Network::cut`] takes a namespace's link down (a cable pulled:
//! no RST, packets vanish), [`Network::restore`] brings it back. Everything is removed on drop. Needs root (or
//! CAP_NET_ADMIN); [`Network::create`] says why when it cannot.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// One namespace: its name, the root-side end of its veth pair, and its address.
#[derive(Debug, Clone)]
pub struct Host {
    /// The namespace's name (`ip netns exec NAME`).
    pub netns: String,
    /// The veth end left in the root namespace, attached to the bridge.
    pub link: String,
    /// The namespace's IPv4 address.
    pub addr: String,
}

/// A bridge and its namespaces.
pub struct Network {
    bridge: String,
    subnet: String,
    /// The bridge's address: the root namespace (etcd, the coordinator) as the namespaces reach it.
    pub gateway: String,
    /// The namespaces, in creation order.
    pub hosts: Vec<Host>,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Network {
    /// Creates a bridge and `hosts` namespaces on a /24 chosen from this process's id (so parallel tests do not
    /// collide). `Err` says why namespaces cannot be made here (not root, no iproute2, ...).
    pub fn create(hosts: usize) -> Result<Self> {
        let id = std::process::id();
        let subnet = format!("10.{}.{}", 100 + (id / 250) % 100, id % 250);
        let mut net = Network {
            bridge: format!("sbr{id}"),
            gateway: format!("{subnet}.1"),
            subnet: subnet.clone(),
            hosts: Vec::with_capacity(hosts),
        };
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}/24", net.gateway), "dev", &net.bridge])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        for i in 0..hosts {
            let host = Host {
                netns: format!("sns{id}-{i}"),
                link: format!("svh{id}-{i}"),
                addr: format!("{subnet}.{}", 10 + i),
            };
            let inner = format!("svn{id}-{i}");
            ip(&["netns", "add", &host.netns])?;
            // Pushed before the links exist, so a failure below still cleans up this namespace.
            net.hosts.push(host.clone());
            ip(&["link", "add", &host.link, "type", "veth", "peer", "name", &inner])?;
            ip(&["link", "set", &inner, "netns", &host.netns])?;
            ip(&["link", "set", &host.link, "master", &net.bridge])?;
            ip(&["link", "set", &host.link, "up"])?;
            let ns = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &host.netns, "ip"];
                all.extend_from_slice(args);
                ip(&all)
            };
            ns(&["link", "set", "lo", "up"])?;
            ns(&["addr", "add", &format!("{}/24", host.addr), "dev", &inner])?;
            ns(&["link", "set", &inner, "up"])?;
        }
        Ok(net)
    }

    /// A command running `program` inside namespace `host`.
    pub fn command(&self, host: usize, program: &std::path::Path) -> Result<Command> {
        let h = self.hosts.get(host).context("no such namespace")?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &h.netns]).arg(program);
        Ok(cmd)
    }

    /// Gives the root namespace another address on the bridge (`<subnet>.<last>`), e.g. for a service that one
    /// namespace alone should lose ([`Network::blackhole`]) while the others, and the tests, still reach the rest.
    pub fn add_root_address(&self, last: u8) -> Result<String> {
        let addr = format!("{}.{last}", self.subnet);
        ip(&["addr", "add", &format!("{addr}/32"), "dev", &self.bridge])?;
        Ok(addr)
    }

    /// Makes `addr` unreachable from namespace `host` (its packets are dropped): a partition of just that path.
    pub fn blackhole(&self, host: usize, addr: &str) -> Result<()> {
        let h = self.hosts.get(host).context("no such namespace")?;
        ip(&["netns", "exec", &h.netns, "ip", "route", "add", "blackhole", &format!("{addr}/32")])
    }

    /// Pulls namespace `host`'s cable: its link goes down, its packets are dropped without a reset.
    pub fn cut(&self, host: usize) -> Result<()> {
        let h = self.hosts.get(host).context("no such namespace")?;
        ip(&["link", "set", &h.link, "down"])
    }

    /// Plugs namespace `host` back in.
    pub fn restore(&self, host: usize) -> Result<()> {
        let h = self.hosts.get(host).context("no such namespace")?;
        ip(&["link", "set", &h.link, "up"])
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for h in &self.hosts {
            // Deleting the namespace deletes its veth end, and with it the pair.
            let _ = ip(&["netns", "del", &h.netns]);
            let _ = ip(&["link", "del", &h.link]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}
