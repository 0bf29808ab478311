// A stand-in for `istioctl ztunnel-config <subcommand> -f dump.json`, written for ztunnel-py's
// tests from reading istioctl's decoder (istio/istio istioctl/pkg/writer/ztunnel/configdump/
// *.go and istioctl/pkg/ztunnelconfig/ztunnelconfig.go). Not istioctl's code: the structs below
// carry the same JSON names and Go types, so encoding/json accepts or rejects a dump exactly as
// istioctl does, and the summaries print the same columns from the same fields.
//
// Usage: decoder <workload|service|service-json|policy|certificate|connections|all> < dump.json
// Exit status 1 and istioctl's error text when the dump does not decode.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
	"ztunnelpy/istioctldecoder/configdump"
)

type dump struct {
	workloads    []*configdump.ZtunnelWorkload
	services     []*configdump.ZtunnelService
	policies     []*configdump.ZtunnelPolicy
	certificates []*configdump.CertsDump
	states       map[string]configdump.WorkloadState
}

func listOrMap[T any](in json.RawMessage, out *[]T) error {
	in = bytes.TrimSpace(in)
	if len(in) == 0 {
		return nil
	}
	if in[0] == '[' {
		return json.Unmarshal(in, out)
	}
	m := map[string]T{}
	if err := json.Unmarshal(in, &m); err != nil {
		return err
	}
	for _, v := range m {
		*out = append(*out, v)
	}
	return nil
}

func prime(b []byte) (*dump, error) {
	var r configdump.RawDump
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("error unmarshalling config dump response from ztunnel: %v", err)
	}
	d := &dump{states: r.WorkloadState}
	if err := listOrMap(r.Services, &d.services); err != nil {
		return nil, err
	}
	if err := listOrMap(r.Workloads, &d.workloads); err != nil {
		return nil, err
	}
	if err := listOrMap(r.Certificates, &d.certificates); err != nil {
		return nil, err
	}
	if err := listOrMap(r.Policies, &d.policies); err != nil {
		return nil, err
	}
	return d, nil
}

func table(w io.Writer, padding int) *tabwriter.Writer {
	return new(tabwriter.Writer).Init(w, 0, 8, padding, ' ', 0)
}

func waypointOf(gw *configdump.GatewayAddress, svcs []*configdump.ZtunnelService) string {
	if gw == nil {
		return "None"
	}
	for _, s := range svcs {
		if s.Namespace+"/"+s.Hostname == gw.Destination {
			return s.Name
		}
		for _, a := range s.Addresses {
			if a == gw.Destination {
				return s.Name
			}
		}
	}
	return "NA"
}

func (d *dump) workloadsSummary(out io.Writer) error {
	w := table(out, 1)
	wls := append([]*configdump.ZtunnelWorkload(nil), d.workloads...)
	sort.Slice(wls, func(i, j int) bool {
		a, b := wls[i].Namespace+"."+wls[i].Name, wls[j].Namespace+"."+wls[j].Name
		if a != b {
			return a < b
		}
		return wls[i].Node < wls[j].Node
	})
	fmt.Fprintln(w, "NAMESPACE\tPOD NAME\tADDRESS\tNODE\tWAYPOINT\tPROTOCOL")
	for _, wl := range wls {
		addr := strings.Join(wl.WorkloadIPs, ",")
		if addr == "" {
			addr = wl.Hostname
		}
		fmt.Fprintf(w, "%v\t%v\t%v\t%v\t%v\t%v\n",
			wl.Namespace, wl.Name, addr, wl.Node, waypointOf(wl.Waypoint, d.services), wl.Protocol)
	}
	return w.Flush()
}

func (d *dump) servicesSummary(out io.Writer) error {
	w := table(out, 1)
	byUID := map[string]*configdump.ZtunnelWorkload{}
	for _, wl := range d.workloads {
		byUID[wl.UID] = wl
	}
	svcs := append([]*configdump.ZtunnelService(nil), d.services...)
	sort.Slice(svcs, func(i, j int) bool {
		a, b := svcs[i], svcs[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		return a.Hostname < b.Hostname
	})
	fmt.Fprintln(w, "NAMESPACE\tSERVICE NAME\tSERVICE VIP\tWAYPOINT\tENDPOINTS")
	for _, s := range svcs {
		ips := []string{}
		for _, a := range s.Addresses {
			if i := strings.Index(a, "/"); i >= 0 {
				ips = append(ips, a[i+1:])
			} else {
				ips = append(ips, "")
			}
		}
		healthy := 0
		for _, ep := range s.Endpoints {
			if wl, ok := byUID[ep.WorkloadUID]; ok && wl.Status == "Healthy" {
				healthy++
			}
		}
		fmt.Fprintf(w, "%v\t%v\t%v\t%v\t%v\n", s.Namespace, s.Name, strings.Join(ips, ","),
			waypointOf(s.Waypoint, d.services), fmt.Sprintf("%d/%d", healthy, len(s.Endpoints)))
	}
	return w.Flush()
}

// serviceDump is `istioctl ztunnel-config service -o json`: the decoded services, sorted as the
// summary, marshalled back with four-space indents (PrintServiceDump).
func (d *dump) serviceDump(out io.Writer) error {
	svcs := append([]*configdump.ZtunnelService(nil), d.services...)
	sort.Slice(svcs, func(i, j int) bool {
		a, b := svcs[i], svcs[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		return a.Hostname < b.Hostname
	})
	b, err := json.MarshalIndent(svcs, "", "    ")
	if err != nil {
		return fmt.Errorf("failed to marshal workloads: %v", err)
	}
	_, err = fmt.Fprintln(out, string(b))
	return err
}

func (d *dump) policiesSummary(out io.Writer) error {
	w := table(out, 1)
	pols := append([]*configdump.ZtunnelPolicy(nil), d.policies...)
	sort.Slice(pols, func(i, j int) bool {
		if pols[i].Namespace != pols[j].Namespace {
			return pols[i].Namespace < pols[j].Namespace
		}
		return pols[i].Name < pols[j].Name
	})
	fmt.Fprintln(w, "NAMESPACE\tPOLICY NAME\tACTION\tSCOPE")
	for _, p := range pols {
		fmt.Fprintf(w, "%v\t%v\t%v\t%v\n", p.Namespace, p.Name, p.Action, p.Scope)
	}
	return w.Flush()
}

func orNA(s string) string {
	if s == "" {
		return "NA"
	}
	return s
}

func valid(c *configdump.Cert) bool {
	if c.ExpirationTime == "" && c.ValidFrom == "" {
		return false
	}
	exp, err := time.Parse(time.RFC3339, c.ExpirationTime)
	if err != nil {
		fmt.Fprintf(os.Stderr, "certificate timestamp (%v) could not be parsed: %v\n", c.ExpirationTime, err)
		return false
	}
	from, err := time.Parse(time.RFC3339, c.ValidFrom)
	if err != nil {
		fmt.Fprintf(os.Stderr, "certificate timestamp (%v) could not be parsed: %v\n", c.ValidFrom, err)
		return false
	}
	now := time.Now()
	return now.After(from) && now.Before(exp)
}

func serialHex(s string) string {
	n, ok := new(big.Int).SetString(s, 10)
	if !ok {
		return "%!x(<nil>)"
	}
	return fmt.Sprintf("%x", n)
}

func (d *dump) certificatesSummary(out io.Writer) error {
	w := table(out, 5)
	fmt.Fprintln(w, "CERTIFICATE NAME\tTYPE\tSTATUS\tVALID CERT\tSERIAL NUMBER\tNOT AFTER\tNOT BEFORE")
	for _, c := range d.certificates {
		state := c.State
		if strings.Contains(state, "Unavailable") {
			state = "Unavailable"
		}
		if len(c.CertChain) == 0 {
			fmt.Fprintf(w, "%v\t%v\t%v\t%v\t%v\t%v\t%v\n", c.Identity, "NA", state, false, "NA", "NA", "NA")
			continue
		}
		legacy := len(c.RootCert) == 0
		for i, ca := range c.CertChain {
			kind := "Intermediate"
			if i == 0 {
				kind = "Leaf"
			} else if i == len(c.CertChain)-1 && legacy {
				kind = "Root"
			}
			fmt.Fprintf(w, "%v\t%v\t%v\t%v\t%v\t%v\t%v\n", c.Identity, kind, state, valid(ca),
				serialHex(ca.SerialNumber), orNA(ca.ExpirationTime), orNA(ca.ValidFrom))
		}
		for _, ca := range c.RootCert {
			fmt.Fprintf(w, "%v\t%v\t%v\t%v\t%v\t%v\t%v\n", c.Identity, "Root", state, valid(ca),
				serialHex(ca.SerialNumber), orNA(ca.ExpirationTime), orNA(ca.ValidFrom))
		}
	}
	return w.Flush()
}

func (d *dump) connectionsSummary(out io.Writer) error {
	w := table(out, 1)
	names := map[string]string{}
	for _, wl := range d.workloads {
		ip := "None"
		if len(wl.WorkloadIPs) > 0 && wl.WorkloadIPs[0] != "" {
			ip = wl.WorkloadIPs[0]
		}
		names[ip] = wl.Name + "." + wl.Namespace
	}
	svcNames := map[string]string{}
	for _, s := range d.services {
		ip := ""
		if len(s.Addresses) > 0 {
			if i := strings.Index(s.Addresses[0], "/"); i >= 0 {
				ip = s.Addresses[0][i+1:]
			}
		}
		if ip == "" {
			ip = "None"
		}
		svcNames[ip] = s.Hostname
	}
	lookup := func(addr string) string {
		host, port, _ := net.SplitHostPort(addr)
		if s, ok := svcNames[host]; ok {
			return net.JoinHostPort(s, port)
		}
		if n, ok := names[host]; ok {
			return net.JoinHostPort(n, port)
		}
		return addr
	}
	states := make([]configdump.WorkloadState, 0, len(d.states))
	for _, s := range d.states {
		states = append(states, s)
	}
	sort.Slice(states, func(i, j int) bool {
		if states[i].Info.Namespace != states[j].Info.Namespace {
			return states[i].Info.Namespace < states[j].Info.Namespace
		}
		return states[i].Info.Name < states[j].Info.Name
	})
	fmt.Fprintln(w, "WORKLOAD\tDIRECTION\tLOCAL\tREMOTE\tREMOTE TARGET\tPROTOCOL")
	for _, st := range states {
		name := st.Info.Name + "." + st.Info.Namespace
		for _, c := range st.Connections.Inbound {
			fmt.Fprintf(w, "%v\tInbound\t%v\t%v\t%v\t%v\n", name, lookup(c.ActualDst), lookup(c.Src), c.OriginalDst, c.Protocol)
		}
		for _, c := range st.Connections.Outbound {
			fmt.Fprintf(w, "%v\tOutbound\t%v\t%v\t%v\t%v\n", name, lookup(c.Src), lookup(c.ActualDst), lookup(c.OriginalDst), c.Protocol)
		}
	}
	return w.Flush()
}

func (d *dump) all(out io.Writer) error {
	for _, part := range []func(io.Writer) error{
		d.workloadsSummary, d.servicesSummary, d.policiesSummary, d.certificatesSummary, d.connectionsSummary,
	} {
		fmt.Fprintln(out)
		if err := part(out); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: decoder <workload|service|service-json|policy|certificate|connections|all> < dump.json")
		os.Exit(2)
	}
	in, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	d, err := prime(in)
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
	print := map[string]func(io.Writer) error{
		"workload":     d.workloadsSummary,
		"service":      d.servicesSummary,
		"service-json": d.serviceDump,
		"policy":       d.policiesSummary,
		"certificate":  d.certificatesSummary,
		"connections":  d.connectionsSummary,
		"all":          d.all,
	}[os.Args[1]]
	if print == nil {
		fmt.Fprintln(os.Stderr, "unknown subcommand", os.Args[1])
		os.Exit(2)
	}
	if err := print(os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}
