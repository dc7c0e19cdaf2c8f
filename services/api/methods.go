package api

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"google.golang.org/grpc"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
)

// Method is what the API knows about one RPC before its handler runs.
type Method struct {
	// Action is the catalog action the method is authorized as.
	Action authz.Action
	// Anonymous methods need no credential (version, health). They still
	// declare an action, so the catalog names everything the API does.
	Anonymous bool
	// OwnCredential marks an anonymous method that checks a credential of
	// its own (TunnelsService.Connect's connect token): it is not held to
	// the per-address anonymous rate; its failed checks spend the
	// address's failed-authentication budget instead.
	OwnCredential bool
}

// APIPackage is the proto package whose services must all be registered.
const APIPackage = "bettercompute.compute.v1"

var methods = map[string]Method{
	computev1.SystemService_Version_FullMethodName: {Action: authz.SystemVersion, Anonymous: true},
	computev1.SystemService_Health_FullMethodName:  {Action: authz.SystemHealth, Anonymous: true},
	computev1.SystemService_WhoAmI_FullMethodName:  {Action: authz.SystemWhoAmI},

	computev1.TenantsService_Create_FullMethodName: {Action: authz.TenantsCreate},
	computev1.TenantsService_Get_FullMethodName:    {Action: authz.TenantsGet},
	computev1.TenantsService_List_FullMethodName:   {Action: authz.TenantsList},

	computev1.IdentitiesService_Create_FullMethodName: {Action: authz.IdentitiesCreate},
	computev1.IdentitiesService_List_FullMethodName:   {Action: authz.IdentitiesList},
	computev1.IdentitiesService_Revoke_FullMethodName: {Action: authz.IdentitiesRevoke},

	computev1.ApiKeysService_Create_FullMethodName: {Action: authz.APIKeysCreate},
	computev1.ApiKeysService_List_FullMethodName:   {Action: authz.APIKeysList},
	computev1.ApiKeysService_Revoke_FullMethodName: {Action: authz.APIKeysRevoke},

	computev1.PoliciesService_Put_FullMethodName:    {Action: authz.PoliciesPut},
	computev1.PoliciesService_Get_FullMethodName:    {Action: authz.PoliciesGet},
	computev1.PoliciesService_List_FullMethodName:   {Action: authz.PoliciesList},
	computev1.PoliciesService_Delete_FullMethodName: {Action: authz.PoliciesDelete},

	computev1.PoolsService_Create_FullMethodName: {Action: authz.PoolsCreate},
	computev1.PoolsService_Get_FullMethodName:    {Action: authz.PoolsGet},
	computev1.PoolsService_List_FullMethodName:   {Action: authz.PoolsList},
	computev1.PoolsService_Update_FullMethodName: {Action: authz.PoolsUpdate},

	computev1.RolloutsService_Create_FullMethodName:   {Action: authz.RolloutsCreate},
	computev1.RolloutsService_Get_FullMethodName:      {Action: authz.RolloutsGet},
	computev1.RolloutsService_List_FullMethodName:     {Action: authz.RolloutsList},
	computev1.RolloutsService_Pause_FullMethodName:    {Action: authz.RolloutsPause},
	computev1.RolloutsService_Resume_FullMethodName:   {Action: authz.RolloutsResume},
	computev1.RolloutsService_Cancel_FullMethodName:   {Action: authz.RolloutsCancel},
	computev1.RolloutsService_Rollback_FullMethodName: {Action: authz.RolloutsRollback},

	computev1.AuditService_List_FullMethodName:   {Action: authz.AuditList},
	computev1.AuditService_Verify_FullMethodName: {Action: authz.AuditVerify},

	computev1.EventsService_List_FullMethodName:  {Action: authz.EventsList},
	computev1.EventsService_Watch_FullMethodName: {Action: authz.EventsWatch},

	computev1.WebhooksService_Create_FullMethodName:         {Action: authz.WebhooksCreate},
	computev1.WebhooksService_Get_FullMethodName:            {Action: authz.WebhooksGet},
	computev1.WebhooksService_List_FullMethodName:           {Action: authz.WebhooksList},
	computev1.WebhooksService_Update_FullMethodName:         {Action: authz.WebhooksUpdate},
	computev1.WebhooksService_Delete_FullMethodName:         {Action: authz.WebhooksDelete},
	computev1.WebhooksService_RotateSecret_FullMethodName:   {Action: authz.WebhooksRotateSecret},
	computev1.WebhooksService_Test_FullMethodName:           {Action: authz.WebhooksTest},
	computev1.WebhooksService_ListDeliveries_FullMethodName: {Action: authz.WebhooksGet},
	computev1.WebhooksService_Redeliver_FullMethodName:      {Action: authz.WebhooksRedeliver},

	computev1.SitesService_Create_FullMethodName:      {Action: authz.SitesCreate},
	computev1.SitesService_Get_FullMethodName:         {Action: authz.SitesGet},
	computev1.SitesService_List_FullMethodName:        {Action: authz.SitesList},
	computev1.SitesService_Delete_FullMethodName:      {Action: authz.SitesDelete},
	computev1.SitesService_CreateToken_FullMethodName: {Action: authz.SiteTokensCreate},
	computev1.SitesService_ListTokens_FullMethodName:  {Action: authz.SiteTokensList},
	computev1.SitesService_RevokeToken_FullMethodName: {Action: authz.SiteTokensRevoke},
	computev1.SitesService_RevokeAgent_FullMethodName: {Action: authz.SitesRevokeAgent},

	computev1.MetalService_Enroll_FullMethodName:  {Action: authz.MetalEnroll},
	computev1.MetalService_Get_FullMethodName:     {Action: authz.MetalGet},
	computev1.MetalService_List_FullMethodName:    {Action: authz.MetalList},
	computev1.MetalService_Deploy_FullMethodName:  {Action: authz.MetalDeploy},
	computev1.MetalService_Release_FullMethodName: {Action: authz.MetalRelease},
	computev1.MetalService_Retry_FullMethodName:   {Action: authz.MetalRetry},
	computev1.MetalService_Rescue_FullMethodName:  {Action: authz.MetalRescue},
	computev1.MetalService_Delete_FullMethodName:  {Action: authz.MetalDelete},

	computev1.TunnelsService_Open_FullMethodName:  {Action: authz.NodesTunnel},
	computev1.TunnelsService_List_FullMethodName:  {Action: authz.TunnelsList},
	computev1.TunnelsService_Close_FullMethodName: {Action: authz.TunnelsClose},
	// The connect token is Connect's credential (tunnels.Connect).
	computev1.TunnelsService_Connect_FullMethodName: {Action: authz.TunnelsConnect, Anonymous: true, OwnCredential: true},

	computev1.JoinTokensService_Create_FullMethodName: {Action: authz.JoinTokensCreate},
	computev1.JoinTokensService_List_FullMethodName:   {Action: authz.JoinTokensList},
	computev1.JoinTokensService_Revoke_FullMethodName: {Action: authz.JoinTokensRevoke},

	computev1.NodesService_Get_FullMethodName:          {Action: authz.NodesGet},
	computev1.NodesService_List_FullMethodName:         {Action: authz.NodesList},
	computev1.NodesService_GetSpec_FullMethodName:      {Action: authz.NodesGet},
	computev1.NodesService_Update_FullMethodName:       {Action: authz.NodesUpdate},
	computev1.NodesService_Revoke_FullMethodName:       {Action: authz.NodesRevoke},
	computev1.NodesService_Drain_FullMethodName:        {Action: authz.NodesDrain},
	computev1.NodesService_Undrain_FullMethodName:      {Action: authz.NodesDrain},
	computev1.NodesService_Retire_FullMethodName:       {Action: authz.NodesRetire},
	computev1.NodesService_ClearRepair_FullMethodName:  {Action: authz.NodesRepair},
	computev1.NodesService_ClearUpgrade_FullMethodName: {Action: authz.NodesRepair},

	computev1.CommandsService_Run_FullMethodName:       {Action: authz.NodesExec},
	computev1.CommandsService_Get_FullMethodName:       {Action: authz.NodesGet},
	computev1.CommandsService_GetOutput_FullMethodName: {Action: authz.NodesGet},
	computev1.CommandsService_List_FullMethodName:      {Action: authz.NodesGet},
	computev1.CommandsService_Cancel_FullMethodName:    {Action: authz.NodesExec},

	computev1.ReservationsService_Create_FullMethodName:  {Action: authz.ReservationsCreate},
	computev1.ReservationsService_Get_FullMethodName:     {Action: authz.ReservationsGet},
	computev1.ReservationsService_List_FullMethodName:    {Action: authz.ReservationsList},
	computev1.ReservationsService_Release_FullMethodName: {Action: authz.ReservationsRelease},

	computev1.InstancesService_Create_FullMethodName:     {Action: authz.InstancesCreate},
	computev1.InstancesService_Get_FullMethodName:        {Action: authz.InstancesGet},
	computev1.InstancesService_List_FullMethodName:       {Action: authz.InstancesList},
	computev1.InstancesService_Stop_FullMethodName:       {Action: authz.InstancesStop},
	computev1.InstancesService_Start_FullMethodName:      {Action: authz.InstancesStart},
	computev1.InstancesService_Resize_FullMethodName:     {Action: authz.InstancesResize},
	computev1.InstancesService_Delete_FullMethodName:     {Action: authz.InstancesDelete},
	computev1.InstancesService_Reboot_FullMethodName:     {Action: authz.InstancesReboot},
	computev1.InstancesService_SetQuota_FullMethodName:   {Action: authz.QuotasSet},
	computev1.InstancesService_ListQuotas_FullMethodName: {Action: authz.CapacityGet},

	computev1.CapacityService_Get_FullMethodName:        {Action: authz.CapacityGet},
	computev1.CapacityService_SetQuota_FullMethodName:   {Action: authz.QuotasSet},
	computev1.CapacityService_ListQuotas_FullMethodName: {Action: authz.CapacityGet},
}

// Methods returns the method registry: every RPC of the API by full gRPC
// method name ("/bettercompute.compute.v1.PoolsService/Create").
func Methods() map[string]Method { return maps.Clone(methods) }

// CheckMethods fails unless every method gs serves from [APIPackage] is in
// the registry with an action from the catalog. It runs at start, so a
// method cannot ship without an authorization action.
func CheckMethods(gs *grpc.Server, registry map[string]Method) error {
	var problems []string
	for svc, info := range gs.GetServiceInfo() {
		if !strings.HasPrefix(svc, APIPackage+".") {
			continue
		}
		for _, m := range info.Methods {
			full := "/" + svc + "/" + m.Name
			entry, ok := registry[full]
			switch {
			case !ok || entry.Action == "":
				problems = append(problems, full+" declares no action")
			case !authz.Known(entry.Action):
				problems = append(problems, fmt.Sprintf("%s declares action %q, which is missing from the catalog", full, entry.Action))
			}
		}
	}
	if len(problems) > 0 {
		slices.Sort(problems)
		return fmt.Errorf("api method registry: %s", strings.Join(problems, "; "))
	}
	return nil
}
