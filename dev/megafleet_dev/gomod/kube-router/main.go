// Command kube-router is kube-router's network policy controller alone, started the way kube-router's
// own Run starts it for --run-firewall (pkg/cmd/kube-router.go), without the router, the service
// proxy and the load balancer allocator: their dependencies (GoBGP, the AWS SDK, Docker's client,
// IPVS) would add 380 packages to the build. It takes kube-router's own flags and refuses any that
// would ask for the parts left out.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/cloudnativelabs/kube-router/v2/pkg/controllers/netpol"
	"github.com/cloudnativelabs/kube-router/v2/pkg/healthcheck"
	"github.com/cloudnativelabs/kube-router/v2/pkg/options"
	"github.com/cloudnativelabs/kube-router/v2/pkg/version"
	"github.com/spf13/pflag"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "%s\n", err)
		os.Exit(1)
	}
}

func run() error {
	klog.InitFlags(nil)
	config := options.NewKubeRouterConfig()
	config.AddFlags(pflag.CommandLine)
	pflag.Parse()
	if err := flag.Set("logtostderr", "true"); err != nil {
		return err
	}
	if err := flag.Set("v", config.VLevel); err != nil {
		return err
	}
	if config.Version {
		version.PrintVersion(false)
		return nil
	}
	if !config.RunFirewall || config.RunRouter || config.RunServiceProxy || config.RunLoadBalancer {
		return errors.New("this build has the network policy controller only: pass --run-firewall=true " +
			"--run-router=false --run-service-proxy=false --run-loadbalancer=false")
	}
	version.PrintVersion(true)
	clientConfig, err := clientcmd.BuildConfigFromFlags(config.Master, config.Kubeconfig)
	if err != nil {
		return fmt.Errorf("failed to build the client configuration: %w", err)
	}
	client, err := kubernetes.NewForConfig(clientConfig)
	if err != nil {
		return fmt.Errorf("failed to create the Kubernetes client: %w", err)
	}

	stopCh := make(chan struct{})
	factory := informers.NewSharedInformerFactory(client, 0)
	pods := factory.Core().V1().Pods().Informer()
	namespaces := factory.Core().V1().Namespaces().Informer()
	policies := factory.Networking().V1().NetworkPolicies().Informer()
	factory.Start(stopCh)
	synced := make(chan bool, 1)
	go func() { synced <- cache.WaitForCacheSync(stopCh, pods.HasSynced, namespaces.HasSynced, policies.HasSynced) }()
	select {
	case ok := <-synced:
		if !ok {
			return errors.New("the informers' caches did not sync")
		}
	case <-time.After(config.CacheSyncTimeout):
		return fmt.Errorf("the informers' caches did not sync in %s", config.CacheSyncTimeout)
	}

	iptablesHandlers, ipsetHandlers, err := netpol.NewIPTablesHandlers(config)
	if err != nil {
		return fmt.Errorf("failed to create the iptables handlers: %w", err)
	}
	var ipsetMutex sync.Mutex
	npc, err := netpol.NewNetworkPolicyController(client, config, pods, policies, namespaces, &ipsetMutex,
		iptablesHandlers, ipsetHandlers)
	if err != nil {
		return fmt.Errorf("failed to create the network policy controller: %w", err)
	}
	for informer, handler := range map[cache.SharedIndexInformer]cache.ResourceEventHandler{
		pods: npc.PodEventHandler, namespaces: npc.NamespaceEventHandler, policies: npc.NetworkPolicyEventHandler,
	} {
		if _, err := informer.AddEventHandler(handler); err != nil {
			return fmt.Errorf("failed to add an event handler: %w", err)
		}
	}

	// No health controller here: the heartbeats the controller sends are read and dropped.
	heartbeats := make(chan *healthcheck.ControllerHeartbeat, 10)
	go func() {
		for range heartbeats {
		}
	}()
	var wg sync.WaitGroup
	wg.Add(1)
	go npc.Run(heartbeats, stopCh, &wg)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	<-signals
	klog.Info("Shutting down the network policy controller")
	close(stopCh)
	wg.Wait()
	return nil
}
